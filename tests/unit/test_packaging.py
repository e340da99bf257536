"""What the pack declares (requirements.txt, pyproject.toml) against what its runtime code imports.

The runtime is the root ``__init__.py``, ``nodes/`` and ``h3_core/``; every third-party module it imports
must be declared, be the host's (torch and ComfyUI's own modules) or be an optional kernel package looked up
at run time. torch, torchvision and torchaudio are never declared: the host has them, built for its GPU.
"""

import ast
import importlib.metadata
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
TORCH_FAMILY = {"torch", "torchvision", "torchaudio"}
# ComfyUI's top-level modules a node pack may import; they come with the host, not from a package index.
HOST_MODULES = TORCH_FAMILY | {
    "comfy",
    "comfy_api",
    "comfy_execution",
    "comfy_extras",
    "folder_paths",
    "latent_preview",
    "node_helpers",
    "nodes",
    "server",
    "psutil",  # in ComfyUI's own requirements; the loaders read the host memory available with it
}
# Kernel packages used when importable, never installed by the pack (h3_core.triton_forms and
# h3_core.attention.kernels import them inside try blocks; the pack runs its PyTorch paths without them).
# cudnn (nvidia-cudnn-frontend) serves only the opt-in fp8 window softmax (h3_core.attention.fp8_cudnn).
OPTIONAL_MODULES = {"triton", "flash_attn", "flash_attn_interface", "cudnn"}
# comfy-kitchen is declared for the quantized linears built on its kernels, before this tree imports it.
DECLARED_NOT_YET_IMPORTED = {"comfy-kitchen"}


def requirement_lines():
    lines = (line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def pyproject_dependencies():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def runtime_files():
    yield ROOT / "__init__.py"
    for folder in ("nodes", "h3_core"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def imported_top_level_modules(path: Path) -> set[str]:
    """Absolute imports, and the module names ``importlib.import_module`` / ``find_spec`` are called with."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) in ("import_module", "find_spec")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return {name.split(".")[0] for name in found}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module → the runtime files importing it, less the standard library and the pack itself."""
    by_module = {}
    for path in runtime_files():
        for module in imported_top_level_modules(path):
            if module not in sys.stdlib_module_names and module != "h3_core":
                by_module.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    return by_module


def test_requirements_txt_and_pyproject_declare_the_same_requirements():
    assert requirement_lines() == pyproject_dependencies()


def test_no_torch_family_requirement_pip_could_act_on():
    declared = {canonicalize_name(Requirement(line).name) for line in requirement_lines() + pyproject_dependencies()}
    assert not declared & TORCH_FAMILY


def test_every_requirement_has_the_floor_the_minimum_lane_installs():
    # tests/lanes/minimum.sh installs each `name>=X` as `name==X`; any other form would go untested there.
    for line in requirement_lines():
        requirement = Requirement(line)
        assert requirement.marker is None and not requirement.extras, line
        assert [spec.operator for spec in requirement.specifier] == [">="], line


def test_every_third_party_import_of_the_runtime_is_declared_or_the_hosts_or_optional():
    declared = {canonicalize_name(Requirement(line).name) for line in requirement_lines()}
    distributions = importlib.metadata.packages_distributions()  # module → the installed distributions giving it
    undeclared = {}
    for module, files in third_party_imports().items():
        if module in HOST_MODULES or module in OPTIONAL_MODULES:
            continue
        given_by = {canonicalize_name(name) for name in distributions.get(module, [])}
        if not given_by & declared:
            undeclared[module] = sorted(files)
    assert undeclared == {}


def test_every_declared_requirement_is_imported_by_the_runtime():
    distributions = importlib.metadata.packages_distributions()
    imported = {canonicalize_name(name) for module in third_party_imports() for name in distributions.get(module, [])}
    unused = {canonicalize_name(Requirement(line).name) for line in requirement_lines()} - imported
    assert unused <= DECLARED_NOT_YET_IMPORTED


def test_the_installed_pack_gives_the_library_alone(tmp_path):
    """What ``pip install`` builds from pyproject.toml: every h3_core module, and nothing that would become a
    top-level name beside the host's own (``nodes``, ``tests``, ``bench``, ``workflows``)."""
    import shutil
    import subprocess
    import zipfile

    source = tmp_path / "source"  # a copy: the build writes its own folders beside the sources
    # links are copied as links (the example's server folder under out/ links back to the checkout)
    ignore = shutil.ignore_patterns(".*", "__pycache__", "build", "*.egg-info", "out")
    shutil.copytree(ROOT, source, symlinks=True, ignore=ignore)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("h3_hybrid-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    library = {p.relative_to(ROOT).as_posix() for p in (ROOT / "h3_core").rglob("*.py")}
    assert names == library
