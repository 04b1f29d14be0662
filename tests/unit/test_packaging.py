"""One installable namespace, checked on pyproject.toml and the source folders: every package folder ships under
``collage.*``. (scripts/wheel_smoke.sh builds the wheel and installs it into fresh environments.)"""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


ROOT = Path(__file__).resolve().parents[2]


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _importable_folders(name: str, folder: Path) -> set[str]:
    """Every folder Python could import under ``name``: a package (``__init__.py``) or a folder of data files
    with an identifier for a name (setuptools treats both as packages and warns about each one left out)."""
    found = set()
    for path in [folder, *sorted(p for p in folder.rglob("*") if p.is_dir())]:
        rel = path.relative_to(folder)
        if any(not part.isidentifier() or part.startswith("__") for part in rel.parts):
            continue  # __pycache__, or a folder no import can name (uplot-1.6.32): plain data of its parent
        if (path / "__init__.py").is_file() or any(p.is_file() for p in path.rglob("*")):
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_folder_is_shipped_under_collage():
    setuptools = PYPROJECT["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in mapping.items():
        assert name.startswith("collage.") and (ROOT / folder).is_dir(), name
        found |= _importable_folders(name, ROOT / folder)
    assert found == listed, f"missing from [tool.setuptools] packages: {found - listed}; stale: {listed - found}"
