"""Reports rendered from a results folder's own runs, as the recipes of its ``manifest.json``
declare them (each one ``lora-bench report`` run writing into the folder), and the check that the
files beside the runs are what the renderer makes of those runs today. Recipes and how files are
compared: docs/committed-reports.md."""

from __future__ import annotations

import base64
import io
import re
import shlex
import struct
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rich.console import Console

from lora_bench.errors import ResultsError
from lora_bench.report.aggregate import FORMATS
from lora_bench.report.report_command import figure_paths, report_command
from lora_bench.report.figures import CONTENT_KEY
from lora_bench.report.stats import THRESHOLD
from lora_bench.results.manifest import MANIFEST, read_manifest

REPORTS = "reports"
SUPERSEDED = "superseded"
OPTIONS = ("plot", "group_by", "baseline", "metrics")  # text options, passed on as given
KEYS = ("format", "output", "inputs", "threshold", *OPTIONS)
REPORT_FILE = re.compile(r"report[^/]*\.(md|html|png|pdf|svg|csv|json|txt)")
FIGURE_FILE = re.compile(r"report[^/]*\.(png|pdf|svg)")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_RECIPES = 64  # reports one folder declares: a study's folder declares a handful
NAME_MAX = 200  # bytes of a report file's name: the file system's 255, with room for a figure's suffix


@dataclass(frozen=True)
class Recipe:
    folder: Path  # the results folder whose manifest declares the report
    name: str  # that folder as the report names it: results/answer/study
    format: str
    output: str
    inputs: tuple[str, ...] = (".",)
    plot: str | None = None
    group_by: str | None = None
    baseline: str | None = None
    metrics: str | None = None
    threshold: float | None = None  # percent

    def input_names(self) -> list[str]:
        return [str(PurePosixPath(self.name, i)) if i != "." else self.name for i in self.inputs]

    def command(self) -> str:
        """The same report as a ``lora-bench report`` command line, from the folder above the root."""
        args = ["lora-bench", "report", *self.input_names(), *(["--pool"] if len(self.inputs) > 1 else [])]
        for key in ("group_by", "baseline", "metrics"):
            if getattr(self, key) is not None:
                args += [f"--{key.replace('_', '-')}", getattr(self, key)]
        if self.threshold is not None:
            args += ["--threshold", f"{self.threshold:g}"]
        args += ["--format", self.format, "--output", f"{self.name}/{self.output}"]
        if self.plot is not None:
            args += ["--plot", f"{self.name}/{self.plot}"]
        return shlex.join(args)


def _file_name(value, key: str, where: str) -> str:
    """A file or folder inside the results folder: relative, no ``..``."""
    if not isinstance(value, str) or not value.strip():
        raise ResultsError(f"{where}: {key} must be a file name inside the folder, not {value!r}")
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts or "\\" in value:
        raise ResultsError(f"{where}: {key} {value!r} must be a relative path inside the folder, without '..'")
    return str(p)


def _report_name(value, key: str, where: str) -> str:
    """A report file the recipe writes: a name in the folder itself (no subfolder) of the form
    ``report*.<ext>`` (what ``stale_reports`` looks for), not a link, nothing else in its way."""
    pattern = FIGURE_FILE if key == "plot" else REPORT_FILE
    allowed = "png, pdf, svg" if key == "plot" else "md, html, png, pdf, svg, csv, json, txt"
    if isinstance(value, str) and len(value.encode(errors="surrogateescape")) > NAME_MAX:
        raise ResultsError(f"{where}: {key} is a name of {len(value.encode(errors='surrogateescape')):,} bytes; a "
                           f"report file's name has at most {NAME_MAX} (the file system's limit is 255)")
    if (not isinstance(value, str) or CONTROL.search(value) or not pattern.fullmatch(value)
            or "/" in value or "\\" in value):
        example = "report.png" if key == "plot" else "report.md"
        raise ResultsError(f"{where}: {key} {value!r} must be a file name in the folder itself starting with 'report' "
                           f"and ending in .{', .'.join(allowed.split(', '))} (e.g. {example}), without control "
                           "characters")
    return value


def _check_writes(recipe: Recipe, where: str, taken: dict[str, str]) -> None:
    """The files ``recipe`` writes: none a link or a folder (a report writes only inside its own
    folder), none that an earlier recipe of the folder writes too."""
    table_only = bool(recipe.group_by or recipe.metrics) or recipe.format in ("csv", "json")
    names = [recipe.output, *(p.name for p in figure_paths(None if recipe.plot is None else Path(recipe.plot),
                                                          fmt=recipe.format, output=Path(recipe.output),
                                                          table_only=table_only).values())]
    for name in names:
        path = recipe.folder / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ResultsError(f"{where}: {name!r} in {recipe.folder} is {'a link' if path.is_symlink() else 'not a file'}; "
                               "a report writes only plain files in its own folder: move it aside")
        if name in taken:
            raise ResultsError(f"{where}: it writes {name!r}, which {taken[name]} writes too; give each report its "
                               "own file names")
        taken[name] = where.rsplit(": ", 1)[-1]


def recipes(folder: Path, *, root: Path) -> list[Recipe]:
    """The reports ``folder``'s manifest declares (none when it declares none); a malformed entry
    raises one ResultsError naming the file, the entry and what is allowed."""
    folder, root = Path(folder), Path(root)
    entries = read_manifest(folder).get(REPORTS, [])
    path = folder / MANIFEST
    if not isinstance(entries, list):
        raise ResultsError(f"{path}: {REPORTS} must be a list of report recipes, not a JSON {type(entries).__name__}")
    if len(entries) > MAX_RECIPES:
        raise ResultsError(f"{path}: {REPORTS} lists {len(entries):,} recipes; a folder declares at most {MAX_RECIPES}")
    try:
        rel = folder.resolve().relative_to(root.resolve())
    except ValueError:
        raise ResultsError(f"{folder} is not inside the results root {root}") from None
    name = str(PurePosixPath(root.resolve().name, *rel.parts))
    out: list[Recipe] = []
    taken: dict[str, str] = {}
    for i, e in enumerate(entries):
        where = f"{path}: {REPORTS}[{i}]"
        if not isinstance(e, dict):
            raise ResultsError(f"{where} must be an object with the keys {', '.join(KEYS)}")
        unknown = sorted(set(e) - set(KEYS))
        if unknown:
            raise ResultsError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
        missing = [k for k in ("format", "output") if k not in e]
        if missing:
            raise ResultsError(f"{where}: {missing[0]} is missing")
        if e["format"] not in FORMATS:
            raise ResultsError(f"{where}: format {e['format']!r} is not allowed; choose one of: {', '.join(FORMATS)}")
        inputs = e.get("inputs", ["."])
        if not isinstance(inputs, list) or not inputs:
            raise ResultsError(f"{where}: inputs must be a non-empty list of folders inside {folder}")
        inputs = [_file_name(x, "inputs", where) for x in inputs]
        for x in inputs:
            if not (folder / x).is_dir() or not (folder / x).resolve().is_relative_to(folder.resolve()):
                raise ResultsError(f"{where}: input {x!r} is not a folder inside {folder}")
        options = {k: e[k] for k in OPTIONS if k in e}
        for k, v in options.items():
            if not isinstance(v, str) or not v.strip():
                raise ResultsError(f"{where}: {k} must be text, not {v!r}")
        if "plot" in options:
            options["plot"] = _report_name(options["plot"], "plot", where)
        threshold = e.get("threshold")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0 <= threshold < 100):
            raise ResultsError(f"{where}: threshold {threshold!r}: give a percentage from 0 up to (not including) 100")
        recipe = Recipe(folder=folder, name=name, format=e["format"], output=_report_name(e["output"], "output", where),
                        inputs=tuple(inputs), threshold=None if threshold is None else float(threshold), **options)
        _check_writes(recipe, where, taken)
        out.append(recipe)
    return out


def declared_folders(root: Path) -> list[Path]:
    """Every folder under ``root`` (itself included) whose manifest declares reports, in path order;
    superseded runs are not looked into."""
    root = Path(root)
    found = []
    for m in sorted(root.rglob(MANIFEST)):
        if SUPERSEDED in m.relative_to(root).parts[:-1]:
            continue
        if read_manifest(m.parent).get(REPORTS):
            found.append(m.parent)
    return found


def render(recipe: Recipe, *, into: Path | None = None) -> list[Path]:
    """Render one recipe from the runs: into its folder, or into ``into`` (the same file names);
    returns the files written."""
    target = Path(into) if into is not None else recipe.folder
    target.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=io.StringIO(), width=160)
    return report_command([recipe.folder / i for i in recipe.inputs], group_by=recipe.group_by,
                          baseline=recipe.baseline, metrics=recipe.metrics, fmt=recipe.format, output=target / recipe.output,
                          plot=None if recipe.plot is None else target / recipe.plot, console=quiet,
                          threshold=THRESHOLD if recipe.threshold is None else recipe.threshold / 100,
                          names=recipe.input_names())


def render_all(folders: list[Path], *, root: Path, into: Path | None = None,
               advance: Callable[[], None] = lambda: None) -> dict[Path, list[Path]]:
    """Render every recipe of ``folders``: folder -> files written (into ``into``/<folder relative
    to root> when given); ``advance()`` after each folder (a progress display's)."""
    out: dict[Path, list[Path]] = {}
    for folder in folders:
        dest = None if into is None else Path(into) / Path(folder).resolve().relative_to(Path(root).resolve())
        for r in recipes(folder, root=root):
            out.setdefault(Path(folder), []).extend(render(r, into=dest))
        advance()
    return out


# -- comparing a committed file with a fresh rendering -------------------------------------------
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EMBEDDED_PNG = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")


def png_facts(data: bytes) -> tuple[int, int, str]:
    """(width, height, content digest) of a PNG; the digest '' when the file holds none."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG file")
    pos, size, text = len(PNG_SIGNATURE), None, {}
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind in (b"tEXt", b"zTXt", b"iTXt"):
            key, _, rest = body.partition(b"\0")
            if kind == b"zTXt":
                rest = zlib.decompress(rest[1:])
            elif kind == b"iTXt":
                compressed, rest = rest[0], rest[2:]
                rest = rest.split(b"\0", 2)[2]
                rest = zlib.decompress(rest) if compressed else rest
            text[key.decode("latin-1")] = rest.decode("utf-8" if kind == b"iTXt" else "latin-1")
        elif kind == b"IEND":
            break
        pos += 12 + length
    if size is None:
        raise ValueError("a PNG file without its header chunk")
    return size[0], size[1], text.get(CONTENT_KEY, "")


def _png_difference(committed: bytes, rendered: bytes) -> str | None:
    try:
        a, b = png_facts(committed), png_facts(rendered)
    except ValueError as e:
        return str(e)
    if a[:2] != b[:2]:
        return f"the figure is {a[0]}×{a[1]} px, the runs give {b[0]}×{b[1]} px"
    if a[2] != b[2]:
        return ("it holds no content digest (drawn by an older renderer)" if not a[2] else
                "it draws other numbers or labels than the runs give")
    return None


def _text_difference(committed: str, rendered: str) -> str | None:
    if committed == rendered:
        return None
    a, b = committed.splitlines(), rendered.splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1} differs: {x[:120]!r}, the runs give {y[:120]!r}"
    return f"it has {len(a)} lines, the runs give {len(b)}"


def compare_file(committed: Path, rendered: Path) -> str | None:
    """Why ``committed`` is not what was rendered (None when it is): see the module's docstring."""
    if not committed.is_file():
        return "it is not committed"
    a, b = committed.read_bytes(), rendered.read_bytes()
    if committed.suffix.lower() == ".png":
        return _png_difference(a, b)
    if committed.suffix.lower() == ".html":
        ta, tb = a.decode("utf-8", "replace"), b.decode("utf-8", "replace")
        ia, ib = EMBEDDED_PNG.findall(ta), EMBEDDED_PNG.findall(tb)
        text = _text_difference(EMBEDDED_PNG.sub("data:image/png;base64,…", ta),
                                EMBEDDED_PNG.sub("data:image/png;base64,…", tb))
        if text:
            return text
        for n, (x, y) in enumerate(zip(ia, ib)):
            why = _png_difference(base64.b64decode(x), base64.b64decode(y))
            if why:
                return f"embedded figure {n + 1}: {why}"
        return None
    if committed.suffix.lower() in (".md", ".csv", ".json", ".txt", ".svg"):
        return _text_difference(a.decode("utf-8", "replace"), b.decode("utf-8", "replace"))
    return None if a == b else "its bytes differ"


def stale_reports(root: Path, folders: list[Path] | None = None, *,
                  advance: Callable[[], None] = lambda: None) -> list[tuple[Path, str]]:
    """Render every declared report of ``folders`` (default: all under ``root``) into a temporary
    folder and compare: (committed file, why it is stale) for each file that differs, is missing,
    or looks like a report (``report*.md``, ``.html``, ``.png``, ...) in a folder with recipes but
    is written by none of them. A folder holding report files and declaring none is stale too.
    ``advance()`` after each declared folder rendered."""
    root = Path(root)
    declared = declared_folders(root)
    asked = declared if folders is None else [Path(f) for f in folders]
    stale: list[tuple[Path, str]] = []
    holding = {p.parent for p in root.rglob("report*")
               if REPORT_FILE.fullmatch(p.name) and SUPERSEDED not in p.relative_to(root).parts[:-1]}
    wanted = None if folders is None else {f.resolve() for f in asked}
    for f in sorted(holding):
        if f.resolve() not in {d.resolve() for d in declared} and (wanted is None or f.resolve() in wanted):
            stale.append((f, f"it holds reports but its {MANIFEST} declares no {REPORTS}"))
    folders = [f for f in asked if f.resolve() in {d.resolve() for d in declared}]
    with tempfile.TemporaryDirectory(prefix="lora-bench-reports-") as tmp:
        written = render_all(folders, root=root, into=Path(tmp), advance=advance)
        for folder in folders:
            rel = Path(folder).resolve().relative_to(root.resolve())
            made = {p.name for p in written.get(Path(folder), [])}
            for name in sorted(made):
                why = compare_file(Path(folder) / name, Path(tmp) / rel / name)
                if why:
                    stale.append((Path(folder) / name, why))
            for p in sorted(Path(folder).iterdir()):
                if p.is_file() and REPORT_FILE.fullmatch(p.name) and p.name not in made:
                    stale.append((p, "no recipe of the folder's manifest writes it"))
    return stale
