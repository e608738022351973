"""settings.ini (nbdev 2, the course's nbdev) and pyproject's [tool.nbdev] (read by nbdev 3 instead) agree."""
import configparser
import json
import re
import tomllib

import pytest

from conftest import ROOT

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier


def settings() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    return dict(cfg["DEFAULT"])


def tool_nbdev() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["nbdev"]


def norm(v) -> str:
    "A setting as nbdev reads it: booleans in either file's spelling, strings stripped."
    s = str(v).strip()
    return s.lower() if s.lower() in ("true", "false") else s


def test_every_nbdev3_key_agrees_with_settings_ini():
    ini, toml = settings(), tool_nbdev()
    missing = sorted(set(toml) - set(ini))
    assert not missing, f"[tool.nbdev] sets {missing}, which settings.ini lacks: add them to settings.ini"
    differ = {k: (ini[k], v) for k, v in toml.items() if norm(ini[k]) != norm(v)}
    assert not differ, f"settings.ini and [tool.nbdev] disagree (ini, toml): {differ}"


def test_paths_and_flags_are_the_projects():
    ini = settings()
    assert (ROOT / ini["nbs_path"]).is_dir() and (ROOT / ini["lib_path"] / "__init__.py").is_file()
    assert ini["update_pyproject"] == "False", "nbdev must not rewrite pyproject.toml (packaging lives there)"
    flags = set(ini["tst_flags"].split())
    used = set()
    for nb in (ROOT / "nbs").glob("*.ipynb"):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                used |= set(re.findall(r"^#\|\s*(\w+)\s*$", "".join(cell["source"]), re.M))
    used -= {"export", "exporti", "exports", "hide"}  # nbdev's own bare directives; the rest are test flags
    assert used <= flags, f"notebooks use flags {sorted(used - flags)} that tst_flags does not list"


def test_version_comes_from_settings_ini():
    init = (ROOT / "distcourse" / "__init__.py").read_text()
    assert f'__version__ = "{settings()["version"]}"' in init, "run nbdev_export: it writes settings.ini's version"
