"""Store torchvision's own eval-transform output for the test cases of tests/eval_preprocess_cases.py
in tests/golden/eval_preprocess_torchvision.npz (run once; the file is committed).

Needs torchvision importable, which clipkit's environment is not required to have: on a CPU-only
machine install it beside the project, not into its venv (timm there breaks ``accelerate``), e.g.

    pip install --no-deps --target /tmp/tv torchvision==0.28.0
    PYTHONPATH=/tmp/tv python tools/make_eval_preprocess_reference.py

For each case the file holds ``pixels/<case>``: ``Compose([Resize(S, BICUBIC, antialias=True),
CenterCrop(S)])`` of the PIL image as [S, S, 3] uint8, and ``tensor/<case>`` for two cases: the
full pipeline with ``ToTensor()`` and ``Normalize(CLIP mean, std)`` as [3, S, S] float32.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from eval_preprocess_cases import CASES, MEAN, STD, case_image  # noqa: E402

OUT = ROOT / "tests" / "golden" / "eval_preprocess_torchvision.npz"
FULL_PIPELINE = ("landscape_640x427", "odd_33x17")


def import_torchvision():
    """torchvision, defining the two op schemas a CUDA build's meta-registrations look for when
    its compiled ops cannot load (../shared/ECOSYSTEM.md); nothing here calls those ops."""
    import torch

    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
        import_torchvision.library = library
    import torchvision

    return torchvision


def main() -> None:
    torchvision = import_torchvision()
    from torchvision import transforms as T

    arrays = {}
    for name, (_, _, size) in CASES.items():
        geometry = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC, antialias=True),
                              T.CenterCrop(size)])  # fmt: skip
        arrays[f"pixels/{name}"] = np.asarray(geometry(case_image(name)), dtype=np.uint8)
        if name in FULL_PIPELINE:
            full = T.Compose([geometry, T.ToTensor(), T.Normalize(MEAN, STD)])
            arrays[f"tensor/{name}"] = full(case_image(name)).numpy()
    np.savez_compressed(OUT, **arrays)
    import PIL

    print(f"{OUT}: {len(arrays)} arrays, torchvision {torchvision.__version__}, Pillow {PIL.__version__}")


if __name__ == "__main__":
    main()
