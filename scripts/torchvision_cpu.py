"""Make the installed torchvision importable beside a CPU torch: `make install-vllm` runs this after
`pip install --no-deps torchvision==<the release built for the installed torch>`.

Why: vLLM's multimodal model files (gemma3_mm, gemma4_mm, gemma4_unified, qwen3_5, mllama4) import transformers'
image processors at module top, and those import `torchvision.transforms.v2`. The registries these machines reach
carry only CUDA builds of torchvision for Linux, and a CUDA build fails to import beside a CPU torch: its compiled
operators (`_C.so`) cannot load without libtorch_cuda, and `torchvision/_meta_registrations.py` then registers fake
kernels for `torchvision::nms` and `qnms` without the guard its other registrations have, so `import torchvision`
raises `operator torchvision::nms does not exist`.

What: delete the CUDA-built binaries (the compiled operators, the image decoders and the CUDA runtime bundled with
them), and give those two registrations the guard the others have. What is left is torchvision's pure-Python part:
transforms (which run on torch's own operators), models and utilities; `torchvision.ops` (nms, roi_align, ...) and
`torchvision.io`'s decoders are absent, and raise when called. attnlens needs the import only: its vLLM engines serve
the language model of a multimodal checkpoint.

    python scripts/torchvision_cpu.py         # idempotent; exits non-zero, saying why, if the import still fails
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

UNGUARDED = '@torch.library.register_fake("torchvision::{op}")'
GUARDED = '@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))'


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision is not installed: nothing to do")
        return 0
    package = Path(spec.origin).parent
    for binary in [*package.glob("*.so"), package.parent / "torchvision.libs"]:
        if binary.is_dir():
            shutil.rmtree(binary)
        elif binary.exists():
            binary.unlink()
    registrations = package / "_meta_registrations.py"
    text = registrations.read_text()
    for op in ("nms", "qnms"):
        text = text.replace(UNGUARDED.format(op=op), GUARDED.format(op=op))
    registrations.write_text(text)
    check = "import torchvision; from torchvision.transforms.v2 import functional; print(torchvision.__version__)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    if result.returncode:
        print(f"torchvision still fails to import:\n{result.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"torchvision {result.stdout.strip()}: the pure-Python part, without its compiled operators")
    return 0


if __name__ == "__main__":
    sys.exit(main())
