"""Jetson detection from fake system files, the advice it leads to, and `edgedecode doctor`.

No Jetson here: each test lays out what a Jetson's files say (``/etc/nv_tegra_release``, the device
tree's model and compatible strings) under a temporary root.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgedecode.cli import app
from edgedecode.runtime import jetson, session
from edgedecode.runtime.jetson import detect_jetson, onnxruntime_advice
from edgedecode.runtime.session import RuntimeSetupError, create_session, import_onnxruntime

ORIN_RELEASE = (
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n"
)
XAVIER_RELEASE = "# R35 (release), REVISION: 5.0, GCID: 35550185, BOARD: t186ref, EABI: aarch64, DATE: Tue Feb 20\n"
THOR_RELEASE = "# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64, DATE: Mon Aug 18\n"
JP6_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"


def fake_root(root: Path, release: str | None = None, model: str | None = None, compatible: str | None = None) -> Path:
    if release is not None:
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc/nv_tegra_release").write_text(release)
    tree = root / "proc/device-tree"
    if model is not None:
        tree.mkdir(parents=True, exist_ok=True)
        (tree / "model").write_bytes(model.encode() + b"\0")
    if compatible is not None:
        tree.mkdir(parents=True, exist_ok=True)
        (tree / "compatible").write_bytes(compatible.encode())
    return root


def test_an_orin_on_jetpack_6_is_recognised_from_its_files(tmp_path):
    root = fake_root(tmp_path, ORIN_RELEASE, "NVIDIA Jetson AGX Orin Developer Kit")
    found = detect_jetson(root)
    assert found is not None
    assert found.model == "NVIDIA Jetson AGX Orin Developer Kit" and found.l4t == "R36.4.3"
    assert found.jetpack is not None and found.jetpack.version == "6" and found.jetpack.index == JP6_INDEX
    assert "JetPack 6" in found.describe() and "CUDA 12.6" in found.describe()


@pytest.mark.parametrize(
    ("files", "l4t", "jetpack"),
    [
        ({"release": XAVIER_RELEASE}, "R35.5.0", "5"),
        ({"release": THOR_RELEASE, "model": "NVIDIA Jetson AGX Thor Developer Kit"}, "R38.2.0", "7"),
        # no release file (a container without /etc from the host): the device tree alone
        ({"compatible": "nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0"}, None, None),
        ({"model": "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super"}, None, None),
    ],
    ids=["xavier-jp5", "thor-jp7", "compatible-only", "model-only"],
)
def test_other_jetsons_are_recognised(tmp_path, files, l4t, jetpack):
    found = detect_jetson(fake_root(tmp_path, **files))
    assert found is not None and found.l4t == l4t
    assert (found.jetpack.version if found.jetpack else None) == jetpack


@pytest.mark.parametrize(
    "files",
    [{}, {"model": "Raspberry Pi 4 Model B Rev 1.4"}, {"compatible": "raspberrypi,4-model-b\0brcm,bcm2711\0"}],
    ids=["x86-64", "raspberry-pi-model", "raspberry-pi-compatible"],
)
def test_other_machines_are_not_jetsons(tmp_path, files):
    assert detect_jetson(fake_root(tmp_path, **files)) is None


def test_the_advice_names_nvidias_build_and_never_the_gpu_extra(tmp_path):
    orin = detect_jetson(fake_root(tmp_path, ORIN_RELEASE, "NVIDIA Jetson Orin NX"))
    assert orin is not None
    assert onnxruntime_advice(orin, ["onnxruntime-gpu"], ["CUDAExecutionProvider", "CPUExecutionProvider"]) is None
    advice = onnxruntime_advice(orin, ["onnxruntime"], ["CPUExecutionProvider"])
    assert advice is not None
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in advice
    assert f"pip install onnxruntime-gpu --index-url {JP6_INDEX}" in advice
    assert "edgedecode[jetson]" in advice and "its onnxruntime (onnxruntime) has no CUDA" in advice
    assert "pip install 'edgedecode[gpu]'" not in advice


def test_jetpack_5_is_told_its_python_is_too_old_for_nvidias_wheels(tmp_path):
    xavier = detect_jetson(fake_root(tmp_path, XAVIER_RELEASE))
    assert xavier is not None
    advice = onnxruntime_advice(xavier, [], [])
    assert advice is not None and "no onnxruntime is installed" in advice
    assert "Python 3.8" in advice and "build onnxruntime from source" in advice and "--index-url" not in advice


@pytest.fixture
def on_orin(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(jetson, "SYSTEM_ROOT", fake_root(tmp_path / "root", ORIN_RELEASE, "NVIDIA Jetson"))


@pytest.fixture
def off_jetson(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(jetson, "SYSTEM_ROOT", tmp_path / "empty-root")


def test_both_builds_installed_on_a_jetson_points_to_nvidias_build(on_orin, monkeypatch):
    monkeypatch.setattr(session, "installed_onnxruntime", lambda: ["onnxruntime", "onnxruntime-gpu"])
    with pytest.raises(RuntimeSetupError) as err:
        import_onnxruntime()
    message = str(err.value)
    assert message.startswith("both onnxruntime and onnxruntime-gpu are installed")
    assert JP6_INDEX in message and "pip install 'edgedecode[gpu]'" not in message


def test_both_builds_installed_elsewhere_keeps_the_gpu_extra_fix(off_jetson, monkeypatch):
    monkeypatch.setattr(session, "installed_onnxruntime", lambda: ["onnxruntime", "onnxruntime-gpu"])
    with pytest.raises(RuntimeSetupError, match=r"pip install 'edgedecode\[gpu\]'") as err:
        import_onnxruntime()
    assert "Jetson" not in str(err.value)


def test_asking_for_cuda_on_a_jetson_without_it_says_what_to_install(on_orin, tmp_path):
    if "cuda" in session.available_devices():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(RuntimeSetupError, match="CUDAExecutionProvider is not available") as err:
        create_session(tmp_path / "unused.onnx", device="cuda")
    assert JP6_INDEX in str(err.value)


runner = CliRunner()


def doctor(config: Path, *extra: str):
    return runner.invoke(app, ["doctor", "--config", str(config), *extra], catch_exceptions=False)


def test_doctor_on_a_jetson_without_cuda(on_orin, tmp_path, monkeypatch):
    if "cuda" in session.available_devices():
        pytest.skip("this onnxruntime has the CUDA provider")
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    config = tmp_path / "edgedecode.toml"
    config.write_text('[model]\ndevice = "cpu"\n')
    result = doctor(config)
    assert result.exit_code == 0, result.output  # the CPU is what it was asked for: a note, not a problem
    assert "Jetson: NVIDIA Jetson, L4T R36.4.3, JetPack 6" in result.output
    assert "note" in result.output and JP6_INDEX in result.output

    config.write_text('[model]\ndevice = "cuda"\n')
    result = doctor(config)
    assert result.exit_code == 1 and "problem" in result.output and JP6_INDEX in result.output


def test_doctor_elsewhere(off_jetson, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    config = tmp_path / "edgedecode.toml"
    config.write_text('[model]\ndevice = "cpu"\n')
    result = doctor(config)
    assert result.exit_code == 0, result.output
    assert "Jetson" not in result.output and "CPUExecutionProvider" in result.output
    assert f"model cache: {tmp_path / 'home'}" in result.output

    config.write_text('[daemon]\nport = "eighty"\n')
    result = doctor(config)
    assert result.exit_code == 1 and "problem" in result.output and "port" in result.output
