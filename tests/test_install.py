"""The project installs under one import name: a package named ``kernels`` (HF's hub kernels),
``dataflow`` or ``layouts`` elsewhere stays importable beside it."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installed_packages_live_under_datamove():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    assert packages and all(p == "datamove" or p.startswith("datamove.") for p in packages)
    assert not [name for name in ("dataflow", "kernels", "layouts") if (ROOT / name).exists()]


def test_other_kernels_package_stays_importable(tmp_path):
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("HUB = True\n")
    # The repository first, so a top-level kernels/ of ours would shadow the other package.
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(hub.parent)!r}]\n"
            "import datamove.kernels.codegen, datamove.dataflow.spec, datamove.layouts.select, datamove.export\n"
            "import kernels; assert kernels.HUB, kernels.__file__\n"
            "print('both', datamove.kernels.codegen.__name__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "both datamove.kernels.codegen" in run.stdout
