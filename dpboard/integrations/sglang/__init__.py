"""The SGLang plugin (entry point ``dpboard`` in SGLang's ``sglang.srt.plugins`` group)."""

def register() -> None:
    from dpboard.integrations.sglang.plugin import register_hooks

    register_hooks()
