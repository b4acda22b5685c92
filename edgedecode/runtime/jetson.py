"""NVIDIA Jetson: recognising one, and which onnxruntime it needs for its GPU.

PyPI's onnxruntime-gpu is built for x86-64 (and Windows) desktop GPUs: on a Jetson ``pip install
'edgedecode[gpu]'`` finds no wheel, or one that cannot drive the Jetson's integrated GPU. The CUDA
provider there comes from NVIDIA's Jetson builds of onnxruntime-gpu, made for one JetPack (its CUDA)
and one Python: the jetson-ai-lab pip index or the Jetson Zoo (docs/deploy.md, section (c)).

A Jetson is recognised from files only (so tests use a fake root): ``/etc/nv_tegra_release`` (the
L4T release, which names the JetPack) or the device tree's model and compatible strings.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

SYSTEM_ROOT = Path("/")
TEGRA_RELEASE = "etc/nv_tegra_release"
DEVICE_TREE = ("proc/device-tree", "sys/firmware/devicetree/base")
DEPLOY_DOC = "docs/deploy.md, section (c) Jetson"
_RELEASE_RE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")


@dataclass(frozen=True)
class JetPack:
    """What a JetPack major release ships (NVIDIA's release notes), and where its onnxruntime-gpu is."""

    version: str
    ubuntu: str
    python: str  # the system Python
    cuda: str
    index: str | None  # NVIDIA's pip index with its onnxruntime-gpu builds; None: none for edgedecode's Pythons


# By L4T major release (the R number in /etc/nv_tegra_release).
JETPACKS = {
    32: JetPack("4", "18.04", "3.6", "10.2", None),
    35: JetPack("5", "20.04", "3.8", "11.4", None),
    36: JetPack("6", "22.04", "3.10", "12.6 (12.2 on 6.0)", "https://pypi.jetson-ai-lab.io/jp6/cu126"),
    38: JetPack("7", "24.04", "3.12", "13.0", None),
}


@dataclass(frozen=True)
class Jetson:
    """A Jetson as its files describe it; any field may be unknown (None)."""

    model: str | None  # the device tree's model, e.g. "NVIDIA Jetson AGX Orin Developer Kit"
    l4t: str | None  # e.g. "R36.4.3"
    l4t_major: int | None

    @property
    def jetpack(self) -> JetPack | None:
        return JETPACKS.get(self.l4t_major) if self.l4t_major is not None else None

    def describe(self) -> str:
        parts = [self.model or "NVIDIA Jetson"]
        if self.l4t:
            jetpack = self.jetpack
            parts.append(f"L4T {self.l4t}" + (f", JetPack {jetpack.version}, CUDA {jetpack.cuda}" if jetpack else ""))
        return ", ".join(parts)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def detect_jetson(root: Path | None = None) -> Jetson | None:
    """The Jetson this is, or None (not a Jetson, or nothing says so)."""
    root = SYSTEM_ROOT if root is None else root
    release = _read(root / TEGRA_RELEASE)
    model = compatible = None
    for tree in DEVICE_TREE:
        model = model or _read(root / tree / "model")
        compatible = compatible or _read(root / tree / "compatible")
    model_text = model.rstrip(b"\0").decode(errors="replace").strip() if model else None
    tegra = compatible is not None and any(s.startswith(b"nvidia,tegra") for s in compatible.split(b"\0"))
    if release is None and not tegra and not (model_text and "jetson" in model_text.lower()):
        return None
    l4t, major = None, None
    if release is not None and (match := _RELEASE_RE.search(release.decode(errors="replace"))):
        major = int(match.group(1))
        l4t = f"R{major}.{match.group(2)}"
    return Jetson(model_text, l4t, major)


def onnxruntime_advice(jetson: Jetson, distributions: list[str], providers: list[str]) -> str | None:
    """What to install on this Jetson for the CUDA provider; None when the installed build has it."""
    if "CUDAExecutionProvider" in providers:
        return None
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    installed = (
        f"its onnxruntime ({' + '.join(distributions)}) has no CUDA execution provider"
        if distributions
        else "no onnxruntime is installed"
    )
    lines = [
        f"this is a Jetson ({jetson.describe()}) and {installed}. PyPI's onnxruntime-gpu is built for x86-64 "
        "GPUs and cannot drive a Jetson's GPU (so 'edgedecode[gpu]' is not for Jetson: install "
        "'edgedecode[jetson]', which leaves onnxruntime to you).",
        "Install NVIDIA's Jetson build of onnxruntime-gpu, made for your JetPack and this Python "
        f"({python}), into this environment:",
        "  pip uninstall -y onnxruntime onnxruntime-gpu",
    ]
    jetpack = jetson.jetpack
    if jetpack is not None and jetpack.index:
        lines.append(f"  pip install onnxruntime-gpu --index-url {jetpack.index}")
    else:
        lines.append(
            "  pip install /path/to/onnxruntime_gpu-<version>-" + python + "-" + python + "-linux_aarch64.whl"
            "   (from the jetson-ai-lab pip index for your JetPack, or the Jetson Zoo)"
        )
    if jetpack is not None and jetpack.index is None and jetson.l4t_major is not None and jetson.l4t_major < 36:
        lines.append(
            f"JetPack {jetpack.version} ships Python {jetpack.python} and CUDA {jetpack.cuda}; NVIDIA publishes no "
            "onnxruntime-gpu for Python >= 3.11 there: build onnxruntime from source (--use_cuda) or move to "
            "JetPack 6 or later."
        )
    lines.append(f'Until then the CPU provider works (device = "cpu"). See {DEPLOY_DOC}.')
    return "\n".join(lines)
