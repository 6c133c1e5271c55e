"""The Python-visible names of ``cupy.cuda.runtime`` and ``cupy.cuda.driver`` in CuPy 13 and 14.

Read from CuPy's own sources at the tags v13.6.0 and v14.2.0 (cupy_backends/cuda/api/runtime.pyx,
runtime.pxd, _runtime_enum.pxd, driver.pyx, driver.pxd, _driver_enum.pxd: the ``cpdef``/``def``
functions, module-level names and ``cpdef enum`` members). tests/support/fake_cupy.py builds
runtimes with exactly these names, so code that touches a name one version lacks fails here as it
would on that version. Facts worth knowing: neither version has ``hostGetDevicePointer`` or the
``cudaHostRegister*`` / ``cudaHostAlloc*`` constants (both have ``hostAllocMapped`` and
``hostAllocPortable``); CuPy 14 adds a few (``streamGetFlags``, ``pointerGetMemoryType``, ...).
"""

_RUNTIME_13 = frozenset("""
    CUDA_C_16F CUDA_C_32F CUDA_C_64F CUDA_C_8I CUDA_C_8U CUDA_R_16F CUDA_R_32F CUDA_R_64F CUDA_R_8I
    CUDA_R_8U check_status createSurfaceObject createTextureObject cudaAddressModeBorder
    cudaAddressModeClamp cudaAddressModeMirror cudaAddressModeWrap cudaArrayDefault
    cudaArraySurfaceLoadStore cudaChannelFormatKindFloat cudaChannelFormatKindNone
    cudaChannelFormatKindSigned cudaChannelFormatKindUnsigned cudaCpuDeviceId cudaFilterModeLinear
    cudaFilterModePoint cudaInvalidDeviceId cudaIpcMemLazyEnablePeerAccess
    cudaLimitDevRuntimePendingLaunchCount cudaLimitDevRuntimeSyncDepth cudaLimitMallocHeapSize
    cudaLimitMaxL2FetchGranularity cudaLimitPrintfFifoSize cudaLimitStackSize cudaMemAdviseSetAccessedBy
    cudaMemAdviseSetPreferredLocation cudaMemAdviseSetReadMostly cudaMemAdviseUnsetAccessedBy
    cudaMemAdviseUnsetPreferredLocation cudaMemAdviseUnsetReadMostly cudaMemAllocationTypePinned
    cudaMemAttachGlobal cudaMemAttachHost cudaMemAttachSingle cudaMemHandleTypeNone
    cudaMemHandleTypePosixFileDescriptor cudaMemLocationTypeDevice cudaMemLocationTypeHost
    cudaMemLocationTypeHostNuma cudaMemLocationTypeHostNumaCurrent cudaMemLocationTypeInvalid
    cudaMemPoolAttrReleaseThreshold cudaMemPoolAttrReservedMemCurrent cudaMemPoolAttrReservedMemHigh
    cudaMemPoolAttrUsedMemCurrent cudaMemPoolAttrUsedMemHigh cudaMemPoolReuseAllowInternalDependencies
    cudaMemPoolReuseAllowOpportunistic cudaMemPoolReuseFollowEventDependencies cudaMemoryTypeDevice
    cudaMemoryTypeHost cudaReadModeElementType cudaReadModeNormalizedFloat cudaResourceTypeArray
    cudaResourceTypeLinear cudaResourceTypeMipmappedArray cudaResourceTypePitch2D destroySurfaceObject
    destroyTextureObject deviceAttributeComputeCapabilityMajor deviceAttributeComputeCapabilityMinor
    deviceCanAccessPeer deviceDisablePeerAccess deviceEnablePeerAccess deviceGetAttribute
    deviceGetByPCIBusId deviceGetDefaultMemPool deviceGetLimit deviceGetMemPool deviceGetPCIBusId
    deviceSetLimit deviceSetMemPool deviceSynchronize driverGetVersion errorContextIsDestroyed
    errorInvalidResourceHandle errorInvalidValue errorMemoryAllocation errorPeerAccessAlreadyEnabled
    eventBlockingSync eventCreate eventCreateWithFlags eventDefault eventDestroy eventDisableTiming
    eventElapsedTime eventInterprocess eventQuery eventRecord eventSynchronize free freeArray freeAsync
    freeHost getDevice getDeviceCount getDeviceProperties graphDestroy graphExecDestroy graphInstantiate
    graphLaunch graphUpload hostAlloc hostAllocDefault hostAllocMapped hostAllocPortable
    hostAllocWriteCombined hostRegister hostUnregister ipcCloseMemHandle ipcGetEventHandle ipcGetMemHandle
    ipcOpenEventHandle ipcOpenMemHandle is_hip launchHostFunc malloc malloc3DArray mallocArray mallocAsync
    mallocFromPoolAsync mallocManaged memAdvise memGetInfo memPoolCreate memPoolDestroy memPoolGetAttribute
    memPoolSetAttribute memPoolTrimTo memPrefetchAsync memcpy memcpy2D memcpy2DAsync memcpy2DFromArray
    memcpy2DFromArrayAsync memcpy2DToArray memcpy2DToArrayAsync memcpy3D memcpy3DAsync memcpyAsync
    memcpyDefault memcpyDeviceToDevice memcpyDeviceToHost memcpyHostToDevice memcpyHostToHost memcpyPeer
    memcpyPeerAsync memoryTypeDevice memoryTypeHost memoryTypeManaged memoryTypeUnregistered memset
    memsetAsync pointerGetAttributes profilerStart profilerStop runtimeGetVersion setDevice
    streamAddCallback streamBeginCapture streamCaptureModeGlobal streamCaptureModeRelaxed
    streamCaptureModeThreadLocal streamCaptureStatusActive streamCaptureStatusInvalidated
    streamCaptureStatusNone streamCreate streamCreateWithFlags streamDefault streamDestroy streamEndCapture
    streamIsCapturing streamLegacy streamNonBlocking streamPerThread streamQuery streamSynchronize
    streamWaitEvent
""".split())
# CuPy 14 has every name of CuPy 13, and these besides.
_RUNTIME_14_ADDS = frozenset("""
    CUDA_R_16BF cudaGraphDebugDotFlagsConditionalNodeParams cudaGraphDebugDotFlagsEventNodeParams
    cudaGraphDebugDotFlagsExtSemasSignalNodeParams cudaGraphDebugDotFlagsExtSemasWaitNodeParams
    cudaGraphDebugDotFlagsHandles cudaGraphDebugDotFlagsHostNodeParams
    cudaGraphDebugDotFlagsKernelNodeAttributes cudaGraphDebugDotFlagsKernelNodeParams
    cudaGraphDebugDotFlagsMemcpyNodeParams cudaGraphDebugDotFlagsMemsetNodeParams
    cudaGraphDebugDotFlagsVerbose graphDebugDotPrint pointerGetMemoryType streamCreateWithPriority
    streamGetFlags streamGetPriority
""".split())
# The driver module's names are the same in both.
_DRIVER = frozenset("""
    CUDA_ERROR_INVALID_VALUE CU_AD_FORMAT_FLOAT CU_AD_FORMAT_HALF CU_AD_FORMAT_SIGNED_INT16
    CU_AD_FORMAT_SIGNED_INT32 CU_AD_FORMAT_SIGNED_INT8 CU_AD_FORMAT_UNSIGNED_INT16
    CU_AD_FORMAT_UNSIGNED_INT32 CU_AD_FORMAT_UNSIGNED_INT8 CU_FUNC_ATTRIBUTE_BINARY_VERSION
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
    CU_FUNC_ATTRIBUTE_NUM_REGS CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    CU_FUNC_ATTRIBUTE_PTX_VERSION CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES CU_JIT_CACHE_MODE
    CU_JIT_ERROR_LOG_BUFFER CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES CU_JIT_FALLBACK_STRATEGY CU_JIT_FAST_COMPILE
    CU_JIT_FMA CU_JIT_FTZ CU_JIT_GENERATE_DEBUG_INFO CU_JIT_GENERATE_LINE_INFO
    CU_JIT_GLOBAL_SYMBOL_ADDRESSES CU_JIT_GLOBAL_SYMBOL_COUNT CU_JIT_GLOBAL_SYMBOL_NAMES
    CU_JIT_INFO_LOG_BUFFER CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES CU_JIT_INPUT_CUBIN CU_JIT_INPUT_FATBINARY
    CU_JIT_INPUT_LIBRARY CU_JIT_INPUT_NVVM CU_JIT_INPUT_OBJECT CU_JIT_INPUT_PTX CU_JIT_LOG_VERBOSE
    CU_JIT_LTO CU_JIT_MAX_REGISTERS CU_JIT_NEW_SM3X_OPT CU_JIT_NUM_OPTIONS CU_JIT_OPTIMIZATION_LEVEL
    CU_JIT_PREC_DIV CU_JIT_PREC_SQRT CU_JIT_TARGET CU_JIT_TARGET_FROM_CUCONTEXT CU_JIT_THREADS_PER_BLOCK
    CU_JIT_WALL_TIME CU_TRSA_OVERRIDE_FORMAT CU_TRSF_NORMALIZED_COORDINATES CU_TRSF_READ_AS_INTEGER
    CU_TRSF_SRGB CU_TR_ADDRESS_MODE_BORDER CU_TR_ADDRESS_MODE_CLAMP CU_TR_ADDRESS_MODE_MIRROR
    CU_TR_ADDRESS_MODE_WRAP CU_TR_FILTER_MODE_LINEAR CU_TR_FILTER_MODE_POINT check_status ctxCreate
    ctxDestroy ctxGetCurrent ctxGetDevice ctxSetCurrent devicePrimaryCtxRelease funcGetAttribute
    funcSetAttribute get_build_version launchCooperativeKernel launchKernel linkAddData linkAddFile
    linkComplete linkCreate linkDestroy moduleGetFunction moduleGetGlobal moduleLoad moduleLoadData
    moduleUnload occupancyMaxActiveBlocksPerMultiprocessor occupancyMaxPotentialBlockSize streamGetCtx
""".split())

RUNTIME_NAMES: dict[str, frozenset[str]] = {"13.6.0": _RUNTIME_13, "14.2.0": _RUNTIME_13 | _RUNTIME_14_ADDS}
DRIVER_NAMES: dict[str, frozenset[str]] = {"13.6.0": _DRIVER, "14.2.0": _DRIVER}
