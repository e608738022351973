"""Build the course website: every lesson executed now, rendered with its outputs, a home page, an API reference.

    python site/build.py            # real sizes: what a learner gets running the lessons (tens of minutes)
    python site/build.py --test     # IN_TEST sizes, as nbdev_test runs them (what CI builds and tests)

Writes site/_build/ (open site/_build/index.html, or `python -m http.server -d site/_build`). The lessons are
executed by this command, in fresh kernels, so the pages can never show outputs of older code; a lesson that
raises fails the build. Each kernel also logs, in order, the Accelerators and GPUs it set up and the times it
forked (site/record_forks.py, into site/_src/forks/; tests/test_forks.py reads them). MkDocs (Material theme, mkdocs-jupyter) renders the pages: it installs from PyPI,
while nbdev's own docs builder needs Quarto, whose installer downloads a binary.
"""
import argparse
import configparser
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC, OUT = ROOT / "site/_src", ROOT / "site/_build"
FORKS = SRC / "forks"  # per lesson: what its kernel process set up and when it forked (tests/test_forks.py)


def lessons() -> list:
    "The lesson notebooks, in course order."
    return sorted((ROOT / "nbs").glob("[0-9]*.ipynb"))


def title_of(nb) -> str:
    "A notebook's `# Title`."
    for cell in nb["cells"]:
        m = re.match(r"#\s+(.+)", "".join(cell["source"]))
        if cell["cell_type"] == "markdown" and m: return m.group(1).strip()
    return "untitled"


def skipped_flags(test, flags=()) -> set:
    "Cell flags not run: `#| eval: false` always; under --test settings.ini's tst_flags but `flags`, as nbdev_test."
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    return {"eval: false", *(set(cfg["DEFAULT"]["tst_flags"].split()) - set(flags) if test else ())}


def record_kernels():
    "Start every lesson's kernel with site/record_forks.py (an IPython start-up file), logging into FORKS."
    startup = SRC / "ipython/profile_default/startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-record_forks.py").write_text(  # in its own namespace: the lesson's names stay the lesson's
        f"import runpy; runpy.run_path({str(ROOT / 'site/record_forks.py')!r}); del runpy\n")
    FORKS.mkdir(parents=True, exist_ok=True)


def execute(path, test, flags=()) -> tuple:
    "Run one lesson top to bottom in a fresh kernel (cwd nbs/); write it with its outputs. (name, seconds, error)."
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError
    os.environ.update({"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # a static page: no live bars
                       "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    if test: os.environ["IN_TEST"] = "1"
    log = FORKS / f"{path.stem}.jsonl"  # the kernel appends its events; the lesson's hash says which version ran
    log.write_text(json.dumps({"event": "start", "source": hashlib.sha256(path.read_bytes()).hexdigest()}) + "\n")
    os.environ.update(IPYTHONDIR=str(SRC / "ipython"), DISTCOURSE_FORK_LOG=str(log))
    nb, t0, error = nbformat.read(path, as_version=4), time.time(), None
    skip = skipped_flags(test, flags)
    for cell in nb.cells:
        cell_flags = set(re.findall(r"^#\|\s*(.+?)\s*$", cell.source, re.M)) if cell.cell_type == "code" else set()
        if cell_flags & skip: cell.metadata.setdefault("tags", []).append("skip-execution")  # nbclient leaves it
    # A cell's limit: at real sizes one cell trains for minutes, and on a 2-core machine shared with another lesson
    # (--jobs 2) or another job it took over 15 (lesson 02's 150 steps); a launch that hangs has its own timeout.
    limit = 900 if test else 3 * 3600
    client = NotebookClient(nb, timeout=limit, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    try: client.execute()
    except CellExecutionError as e: error = str(e).strip().splitlines()[-1]
    except CellTimeoutError: error = f"a cell ran past {limit} s (raise the limit in site/build.py if it was only slow)"
    with open(log, "a") as f: f.write(json.dumps({"event": "end", "error": error}) + "\n")  # it ran to its end
    nbformat.write(nb, SRC / "lessons" / path.name)
    return path.stem, round(time.time() - t0, 1), error


def signature(obj) -> str:
    try: return f"{obj.__name__}{inspect.signature(obj)}"
    except (TypeError, ValueError): return obj.__name__


def api_page(module) -> str:
    "Markdown for one module: its docstring, then each public name with signature, docstring and docments."
    from fastcore.docments import docments
    mod = importlib.import_module(module)
    lines = [f"# `{module}`", "", inspect.getdoc(mod) or "", ""]
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            lines += [f"## `{name}`", "", f"```python\n{name} = {obj!r}\n```", ""]
            continue
        lines += [f"## `{name}`", "", f"```python\n{signature(obj)}\n```", "", inspect.getdoc(obj) or "", ""]
        try: params = docments(obj, full=True)
        except (TypeError, ValueError, OSError): params = {}
        rows = [(k, v) for k, v in params.items() if k != "return" and (v.get("docment") or v.get("default") is not inspect._empty)]
        if rows:
            lines += ["| parameter | default | meaning |", "|---|---|---|"]
            for k, v in rows:
                default = "" if v.get("default") is inspect._empty else f"`{v['default']!r}`"
                lines.append(f"| `{k}` | {default} | {(v.get('docment') or '').replace('|', '/')} |")
            lines.append("")
    return "\n".join(lines)


def home(pages) -> str:
    "The home page: the README's opening and set-up, the lesson map linking to the rendered lessons."
    readme = (ROOT / "README.md").read_text()
    intro = readme[:readme.index("## Lessons")]
    table = readme[readme.index("## Lessons"):]
    table = table[:table.index("\n\n", table.index("|"))]  # the lesson map: up to the end of its table
    table = re.sub(r"\]\(nbs/([^)]+)\.ipynb\)", r"](lessons/\1.ipynb)", table)
    missing = [n for n in re.findall(r"\(lessons/([^)]+)\.ipynb\)", table) if n not in pages]
    if missing: raise SystemExit(f"README's lesson table links {missing}, which are not lessons in nbs/")
    return intro + table + "\n\nThe API reference of the `distcourse` package is under **API** in the navigation.\n"


def config(pages, modules) -> dict:
    return {"site_name": "distcourse", "docs_dir": str(SRC / "docs"), "site_dir": str(OUT),
            "use_directory_urls": False, "theme": {"name": "material", "features": ["navigation.footer"]},
            "markdown_extensions": ["tables", "admonition", "pymdownx.highlight", "pymdownx.superfences"],
            "plugins": [{"mkdocs-jupyter": {"execute": False, "include_source": True, "ignore_h1_titles": False}}],
            "nav": [{"Home": "index.md"}, {"Lessons": [{f"{n.split('_')[0]} {t}": f"lessons/{n}.ipynb"}
                                                       for n, t in pages.items()]},
                    {"API": [{m: f"api/{m}.md"} for m in modules]}]}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python site/build.py", description=__doc__.splitlines()[0])
    p.add_argument("--test", action="store_true", help="IN_TEST sizes (minutes instead of tens of minutes)")
    p.add_argument("--flags", nargs="*", default=[], help="under --test, run the cells with these tst_flags too, "
                   "as `nbdev_test --flags slow` does (CI: slow)")
    p.add_argument("--jobs", type=int, default=2, help="lessons executed at once")
    args = p.parse_args(argv)
    shutil.rmtree(SRC, ignore_errors=True)
    (SRC / "lessons").mkdir(parents=True)
    record_kernels()
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        n, results = len(lessons()), []
        for name, secs, error in pool.map(execute, lessons(), [args.test] * n, [args.flags] * n):  # course order
            print(f"{name:<28} {secs:>6.1f} s  {'ERROR: ' + error if error else 'ok'}", flush=True)
            results.append((name, secs, error))
    if failed := [n for n, _, e in results if e]: raise SystemExit(f"lessons raised: {failed}; no site built")
    docs = SRC / "docs"
    (docs / "api").mkdir(parents=True)
    shutil.move(str(SRC / "lessons"), docs / "lessons")
    pages = {path.stem: title_of(json.loads(path.read_text())) for path in sorted((docs / "lessons").glob("*.ipynb"))}
    modules = sorted(f"distcourse.{f.stem}" for f in (ROOT / "distcourse").glob("[a-z]*.py"))
    for m in modules: (docs / "api" / f"{m}.md").write_text(api_page(m))
    (docs / "index.md").write_text(home(pages))
    # the pages the home page links to: its figure, docs/*.md and CONTRIBUTING.md
    shutil.copytree(ROOT / "docs", docs / "docs", ignore=shutil.ignore_patterns("*.py"))
    shutil.copy(ROOT / "CONTRIBUTING.md", docs / "CONTRIBUTING.md")
    (SRC / "mkdocs.yml").write_text(json.dumps(config(pages, modules), indent=1))  # JSON is YAML
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(SRC / "mkdocs.yml")],
                   cwd=SRC, check=True)  # mkdocs-jupyter caches its conversions in the working directory
    print(f"site/_build/ ({len(pages)} lessons, {len(modules)} API pages) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
