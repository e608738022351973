"""Execute the lessons and build the course website from their outputs.

    python site/build.py                    # every lesson at real sizes, outputs written into nbs/, then the site
    python site/build.py 05a_zero 03        # only these lessons (after editing them), then the site
    python site/build.py --render           # the site from the committed outputs, executing nothing (seconds)
    python site/build.py --check            # fails naming each lesson whose outputs are older than its code
    python site/build.py --test --flags slow  # CI: each lesson once under nbdev_test's rules, then the site

The lessons in nbs/ are committed with the outputs of their real-size execution, so they can be read (on a code
host, in JupyterLab, on the site) before anything runs. Each lesson's notebook metadata holds the hash of the code
its outputs came from (`distcourse.code`); `--check` (CI's first test) fails when a lesson's code has changed since,
naming the command that refreshes it. A lesson that raises keeps its old outputs and fails the build.
The site is rendered from the committed outputs, never from a second execution; `--test` executes each lesson
once in a scratch copy at IN_TEST sizes, as `nbdev_test` does, to prove it still runs. Each kernel also logs the
Accelerators and GPUs it set up and the times it forked (site/record_forks.py, into site/_src/forks/;
tests/test_forks.py reads them). MkDocs (Material theme, mkdocs-jupyter) renders the pages: it installs from PyPI,
while nbdev's own docs builder needs Quarto, whose installer downloads a binary.
"""
import argparse
import configparser
import difflib
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC, OUT = ROOT / "site/_src", ROOT / "site/_build"
FORKS = SRC / "forks"  # per lesson: what its kernel process set up and when it forked (tests/test_forks.py)
MAX_BYTES = 1_000_000  # a committed lesson with its outputs; figures are PNGs at a modest resolution
REFRESH = "python site/build.py"


def lessons() -> list:
    "The lesson notebooks, in course order."
    return sorted((ROOT / "nbs").glob("[0-9]*.ipynb"))


def title_of(nb) -> str:
    "A notebook's `# Title`."
    for cell in nb["cells"]:
        m = re.match(r"#\s+(.+)", "".join(cell["source"]))
        if cell["cell_type"] == "markdown" and m: return m.group(1).strip()
    return "untitled"


def code_hash(nb) -> str:
    "The hash of a notebook's code cells, in order: what its outputs depend on (prose edits leave it alone)."
    code = [c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            for c in nb["cells"] if c["cell_type"] == "code"]
    return hashlib.sha256("\n\x00\n".join(code).encode()).hexdigest()[:16]


def problems(path) -> list:
    "What is wrong with a committed lesson's outputs (empty: fresh)."
    nb = json.loads(path.read_text())
    stamp = nb.get("metadata", {}).get("distcourse", {}).get("code")
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    if stamp is None: return ["committed without outputs"]
    found = [] if stamp == code_hash(nb) else ["its code changed since its outputs were made"]
    if any(o["output_type"] == "error" for o in outputs): found.append("an error in its outputs")
    if not any("image/png" in o.get("data", {}) for o in outputs): found.append("no figure in its outputs")
    if (size := path.stat().st_size) > MAX_BYTES: found.append(f"{size / 1e6:.1f} MB with its outputs (> 1 MB)")
    return found


def check(paths) -> list:
    "Print each stale lesson with the command that refreshes it; the stale names."
    stale = {p.stem: why for p in paths if (why := problems(p))}
    for name, why in stale.items(): print(f"{name}: {'; '.join(why)}")
    if stale: print(f"refresh them (real sizes, their outputs written into nbs/): {REFRESH} {' '.join(stale)}")
    return list(stale)


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
        f"import runpy; runpy.run_path({str(ROOT / 'site/record_forks.py')!r}); del runpy\n"
        "get_ipython().run_line_magic('config', \"InlineBackend.figure_formats = ['png']\")\n")
    FORKS.mkdir(parents=True, exist_ok=True)


def scrub(text: str) -> str:
    "An output without this machine's paths: no checkout root, libraries from site-packages on, temporary dirs <tmp>."
    text = re.sub(r"[^\s'\"]*/site-packages/", "", text.replace(f"{ROOT}/", "").replace(str(ROOT), "."))
    return re.sub(re.escape(tempfile.gettempdir()) + r"/[\w.-]+", "<tmp>", text)


def scrubbed(output: dict) -> dict:
    "A cell output whose text (a stream, a warning, a repr) names no machine's paths."
    output = json.loads(json.dumps(output))
    if "text" in output: output["text"] = scrub("".join(output["text"]))
    for kind, value in output.get("data", {}).items():
        if kind.startswith("text/"): output["data"][kind] = scrub("".join(value))
    return output


def write_back(path, nb, before):
    "Copy an executed lesson's outputs into nbs/, stamped with its code's hash; refuse if it was edited meanwhile."
    from nbdev.clean import nbdev_clean
    if path.read_bytes() != before: return f"{path.name} was edited while it ran: its outputs were not written"
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor
    CoalesceStreamsPreprocessor().preprocess(nb, {})  # one stream per cell, progress bars at their last state
    src = json.loads(before)
    for cell, ran in zip(src["cells"], nb.cells):
        if cell["cell_type"] == "code": cell["outputs"] = [scrubbed(o) for o in ran.get("outputs", [])]
    src["metadata"]["distcourse"] = {"code": code_hash(src)}
    path.write_text(json.dumps(src, indent=1, ensure_ascii=False) + "\n")
    nbdev_clean(fname=str(path))  # the repository's format: no execution counts, no object addresses


def execute(path, test, flags=()) -> tuple:
    "Run one lesson top to bottom in a fresh kernel (cwd nbs/). Real sizes: outputs into nbs/. (name, s, error)."
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError
    os.environ.update({"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # a static page: no live bars
                       "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    if test: os.environ["IN_TEST"] = "1"
    before = path.read_bytes()
    log = FORKS / f"{path.stem}.jsonl"  # the kernel appends its events; the code's hash says which version ran
    log.write_text(json.dumps({"event": "start", "source": code_hash(json.loads(before))}) + "\n")
    os.environ.update(IPYTHONDIR=str(SRC / "ipython"), DISTCOURSE_FORK_LOG=str(log))
    nb, t0, error = nbformat.reads(before.decode(), as_version=4), time.time(), None
    skip = skipped_flags(test, flags)
    for cell in nb.cells:
        cell_flags = set(re.findall(r"^#\|\s*(.+?)\s*$", cell.source, re.M)) if cell.cell_type == "code" else set()
        if cell_flags & skip: cell.metadata.setdefault("tags", []).append("skip-execution")  # nbclient leaves it
    # A cell's limit: at real sizes one cell trains for minutes, and on a 2-core machine shared with another lesson
    # (--jobs 2) or another job it took over 15 (lesson 02's 150 steps); a launch that hangs has its own timeout.
    limit = 900 if test else 3 * 3600
    client = NotebookClient(nb, timeout=limit, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try: client.execute()
    except CellExecutionError as e: error = re.sub(r"\x1b\[[0-9;]*m", "", str(e).strip().splitlines()[-1])
    except CellTimeoutError: error = f"a cell ran past {limit} s (raise the limit in site/build.py if it was only slow)"
    with open(log, "a") as f: f.write(json.dumps({"event": "end", "error": error}) + "\n")  # it ran to its end
    if not test and not error: error = write_back(path, nb, before)
    return path.stem, round(time.time() - t0, 1), error


def run_lessons(paths, test, flags, jobs) -> list:
    "Execute the lessons, `jobs` at a time, printing each as it ends; the names of those that raised."
    record_kernels()
    sizes = "IN_TEST sizes, in a scratch copy" if test else "real sizes, outputs written into nbs/"
    print(f"executing {len(paths)} lessons ({sizes}), {jobs} at a time", flush=True)
    failed, t0 = [], time.time()
    # Side by side, idle OpenMP threads sleep: by default they spin a while, taking the core the other lesson's
    # work needs on 2 cores (lessons 04c and 05aa together: 177 s spinning, 51 s passive; one after the other,
    # spinning, 51 s; measured 2026-11-30 on 2 cores of an AMD EPYC). One lesson alone keeps the default.
    if jobs > 1: os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    with ProcessPoolExecutor(jobs) as pool:
        runs = [pool.submit(execute, p, test, flags) for p in paths]
        for k, run in enumerate(as_completed(runs), 1):
            name, secs, error = run.result()
            print(f"[{k:>2}/{len(paths)}] {name:<28} {secs:>6.1f} s  {'ERROR: ' + error if error else 'ok'}"
                  f"  ({time.time() - t0:.0f} s so far)", flush=True)
            if error: failed.append(name)
    return failed


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
        rows = [(k, v) for k, v in params.items()
                if k != "return" and (v.get("docment") or v.get("default") is not inspect._empty)]
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


def page_of(path) -> dict:
    "A lesson as its page shows it: the committed outputs, the folded check cells (`#| hide`) left out."
    nb = json.loads(path.read_text())
    nb["cells"] = [c for c in nb["cells"] if not re.match(r"#\|\s*hide\b", "".join(c["source"]))]
    return nb


def config(pages, modules) -> dict:
    return {"site_name": "distcourse", "docs_dir": str(SRC / "docs"), "site_dir": str(OUT),
            "use_directory_urls": False, "theme": {"name": "material", "features": ["navigation.footer"]},
            "markdown_extensions": ["tables", "admonition", "pymdownx.highlight", "pymdownx.superfences"],
            "plugins": [{"mkdocs-jupyter": {"execute": False, "include_source": True, "ignore_h1_titles": False}}],
            "nav": [{"Home": "index.md"}, {"Lessons": [{f"{n.split('_')[0]} {t}": f"lessons/{n}.ipynb"}
                                                       for n, t in pages.items()]},
                    {"API": [{m: f"api/{m}.md"} for m in modules]}]}


def render():
    "The site from the committed lessons: their pages, a home page, an API reference, into site/_build/."
    t0, docs = time.time(), SRC / "docs"
    shutil.rmtree(docs, ignore_errors=True)
    (docs / "api").mkdir(parents=True)
    (docs / "lessons").mkdir()
    pages = {}
    for path in lessons():
        nb = page_of(path)
        (docs / "lessons" / path.name).write_text(json.dumps(nb))
        pages[path.stem] = title_of(nb)
    modules = sorted(f"distcourse.{f.stem}" for f in (ROOT / "distcourse").glob("[a-z]*.py"))
    for m in modules: (docs / "api" / f"{m}.md").write_text(api_page(m))
    (docs / "index.md").write_text(home(pages))
    # the pages the home page links to: its figure, docs/*.md and CONTRIBUTING.md
    shutil.copytree(ROOT / "docs", docs / "docs", ignore=shutil.ignore_patterns("*.py"))
    shutil.copy(ROOT / "CONTRIBUTING.md", docs / "CONTRIBUTING.md")
    (SRC / "mkdocs.yml").write_text(json.dumps(config(pages, modules), indent=1))  # JSON is YAML
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(SRC / "mkdocs.yml")],
                   cwd=SRC, check=True)  # mkdocs-jupyter caches its conversions in the working directory
    print(f"site/_build/ ({len(pages)} lessons, {len(modules)} API pages) rendered in {time.time() - t0:.0f} s")


def chosen(names) -> list:
    "The lessons named (a full name or a unique prefix: `05a`), or every lesson."
    every = lessons()
    if not names: return every
    picked = []
    for name in names:
        hits = [p for p in every if p.stem == name] or [p for p in every if p.stem.startswith(name)]
        if len(hits) != 1:
            near = difflib.get_close_matches(name, [p.stem for p in every], n=3, cutoff=0.3)
            options = ", ".join(near or [p.stem for p in hits])
            raise SystemExit(f"{name!r} names {len(hits)} lessons; one of: {options}")
        picked += hits
    return picked


def main(argv=None):
    p = argparse.ArgumentParser(prog="python site/build.py", description=__doc__.splitlines()[0])
    p.add_argument("lessons", nargs="*", help="lessons to execute (names or prefixes such as 05a); default all")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--render", action="store_true", help="render the committed outputs; execute nothing")
    mode.add_argument("--check", action="store_true", help="fail if a lesson's outputs are older than its code")
    mode.add_argument("--test", action="store_true", help="execute at IN_TEST sizes in a scratch copy (CI)")
    p.add_argument("--flags", nargs="*", default=[], help="under --test, run the cells with these tst_flags too, "
                   "as `nbdev_test --flags slow` does (CI: slow)")
    p.add_argument("--jobs", type=int, default=2, help="lessons executed at once")
    args = p.parse_args(argv)
    os.chdir(ROOT)  # nbdev_clean reads settings.ini from here
    paths = chosen(args.lessons)
    if args.check:
        stale = check(paths)
        if stale: raise SystemExit(1)
        return print(f"{len(paths)} lessons: outputs fresh (made by their current code, a figure each, < 1 MB)")
    if not args.render:
        failed = run_lessons(paths, args.test, args.flags, args.jobs)
        if failed: raise SystemExit(f"lessons raised: {failed} (their committed outputs are unchanged); no site built")
    if stale := [p.stem for p in lessons() if problems(p)]:
        print(f"note: {len(stale)} lessons' outputs are stale ({', '.join(stale[:5])}...): `{REFRESH} --check`")
    render()


if __name__ == "__main__":
    main()
