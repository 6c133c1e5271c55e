"""docs/DISPATCH-RESULTS.md's tables are what tools/lockstep_sweep.py renders from docs/results/*.json,
each study's picture is drawn from that data (the same file every time) and linked beside its
tables, the guide (docs/DISPATCH.md) quotes only figures that data holds, the two files' links
resolve, and a sweep's cells condense into the same data. The tool runs as a user runs it, in a
subprocess."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from tests.support.names import ROOT

TOOL = ROOT / "tools" / "lockstep_sweep.py"
GUIDE = ROOT / "docs" / "DISPATCH.md"
RESULTS_DOC = ROOT / "docs" / "DISPATCH-RESULTS.md"
DATA = ROOT / "docs" / "results"
MARKER = re.compile(r"^<!-- results (\S+) (\S+) -->$", re.M)
# the results files that compare methods cell by cell: one picture each, FILE.png beside FILE.json
STUDIES = ("azure", "mooncake", "scenarios", "lockstep-cells", "lockstep-sweep", "wave-sweep")
# a figure: digits not glued to a word ("p99" is a name, not a figure)
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")
# a citation of a section: docs/DISPATCH.md, "Title" or docs/DISPATCH.md ("Title")
CITATION = re.compile(r'docs/(DISPATCH(?:-RESULTS)?\.md)(?:, | \()"([^"\n]+)"')


def sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line index, level, title) of every heading outside code blocks."""
    out, code = [], False
    for i, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            code = not code
        elif not code and (m := re.match(r"(#{1,6}) (.+)", line)):
            out.append((i, len(m.group(1)), m.group(2)))
    return out


def section_tables(text: str, anchor: str) -> list[tuple[str, str]]:
    """The (file, id) of every table marked in the section of that anchor, its subsections included."""
    lines = text.splitlines()
    heads = headings(text)
    for n, (start, level, title) in enumerate(heads):
        if slug(title) == anchor:
            end = next((i for i, lv, _ in heads[n + 1:] if lv <= level), len(lines))
            return MARKER.findall("\n".join(lines[start:end]))
    raise AssertionError(f"no section #{anchor} in {RESULTS_DOC.name}")


def copy_docs(tmp_path: Path) -> tuple[Path, Path]:
    doc, data = tmp_path / "DISPATCH-RESULTS.md", tmp_path / "results"
    shutil.copy(RESULTS_DOC, doc)
    shutil.copytree(DATA, data)
    return doc, data


def png_text(path: Path) -> dict[str, str]:
    """A PNG's text chunks (the tool writes the digest of a picture's data into one)."""
    data, out, at = path.read_bytes(), {}, 8
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"tEXt":
            key, _, value = data[at + 8:at + 8 + size].partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + size
    return out


def test_the_results_markdown_is_what_the_tool_renders_from_the_data():
    done = sweep("table", "--check")
    assert done.returncode == 0, done.stderr
    tables = sum(len(json.loads(p.read_text())["tables"]) for p in DATA.glob("*.json"))
    assert len(MARKER.findall(RESULTS_DOC.read_text())) == tables >= 30


def test_a_figure_changed_in_the_data_is_caught_then_rendered(tmp_path):
    doc, data = copy_docs(tmp_path)
    azure = json.loads((data / "azure.json").read_text())
    row = azure["tables"][0]["rows"][0]
    assert row[0] == "round_robin"
    row[2] = "99999"
    (data / "azure.json").write_text(json.dumps(azure))
    paths = ("--doc", str(doc), "--results", str(data))
    drawn_from = png_text(data / "azure.png")["Data"]
    stale = sweep("table", "--check", *paths)
    # the table and the picture drawn from it are both stale, the other pictures not
    assert stale.returncode == 1 and "azure.json azure-0.6" in stale.stderr, stale.stderr
    assert "azure.png" in stale.stderr and "mooncake.png" not in stale.stderr, stale.stderr
    assert "| round_robin | 46 | 99999 |" not in doc.read_text()
    done = sweep("table", *paths)
    assert done.returncode == 0 and "pictures redrawn: azure.png" in done.stdout, done.stdout + done.stderr
    assert "| round_robin | 46 | 99999 |" in doc.read_text()
    assert png_text(data / "azure.png")["Data"] != drawn_from
    assert sweep("table", "--check", *paths).returncode == 0


def test_a_table_the_markdown_leaves_out_is_an_error(tmp_path):
    doc, data = copy_docs(tmp_path)
    text = doc.read_text()
    region = re.search(r"<!-- results calibration\.json calibration -->.*?<!-- /results -->\n", text, re.S)
    doc.write_text(text.replace(region.group(0), ""))
    done = sweep("table", "--check", "--doc", str(doc), "--results", str(data))
    assert done.returncode != 0 and "calibration.json calibration" in done.stderr, done.stderr


def test_every_study_has_its_picture_linked_in_the_section_of_its_tables():
    sections: dict[str, set[str]] = {}  # results file -> the sections (##) its tables stand in
    links: dict[str, str] = {}  # picture -> the section that links it
    section = ""
    for line in RESULTS_DOC.read_text().splitlines():
        if re.match(r"#{1,2} ", line):
            section = line
        if m := MARKER.match(line):
            sections.setdefault(m.group(1), set()).add(section)
        for picture in re.findall(r"!\[[^\]]*\]\(results/([^)]+\.png)\)", line):
            links[picture] = section
    assert sorted(links) == sorted(f"{s}.png" for s in STUDIES)
    for name in STUDIES:
        assert links[f"{name}.png"] in sections[f"{name}.json"], f"{name}.png is linked away from its tables"
        assert png_text(DATA / f"{name}.png")["Source"] == "tools/lockstep_sweep.py picture"


def test_a_picture_is_drawn_the_same_every_time(tmp_path):
    doc, data = copy_docs(tmp_path)
    names = ("azure.png", "lockstep-cells.png", "wave-sweep.png")  # each kind of picture
    for path in (data / n for n in names):
        path.unlink()
    done = sweep("picture", "--results", str(data), "--only", "azure,lockstep-cells,wave-sweep.json")
    assert done.returncode == 0, done.stderr
    first = {n: (data / n).read_bytes() for n in names}
    assert sweep("table", "--check", "--doc", str(doc), "--results", str(data)).returncode == 0
    assert sweep("picture", "--results", str(data), "--only", "azure,lockstep-cells,wave-sweep").returncode == 0
    assert {n: (data / n).read_bytes() for n in names} == first
    for n in names:
        drawn, committed = png_text(data / n), png_text(DATA / n)
        assert drawn["Data"] == committed["Data"] and "Software" not in drawn  # no version, no date
        if drawn["Renderer"] == committed["Renderer"]:  # the same matplotlib: the same bytes as committed
            assert first[n] == (DATA / n).read_bytes(), f"docs/results/{n} is not what the tool draws"


def test_a_picture_linked_nowhere_is_an_error(tmp_path):
    doc, data = copy_docs(tmp_path)
    text = doc.read_text()
    assert "](results/calibration.png)" not in text  # calibration compares no methods: no picture
    doc.write_text(re.sub(r"!\[[^\]]*\]\(results/mooncake\.png\)\n", "", text))
    done = sweep("table", "--check", "--doc", str(doc), "--results", str(data))
    assert done.returncode == 1 and "linked nowhere: mooncake.png" in done.stderr, done.stderr


def test_every_figure_the_guide_links_to_is_in_the_data():
    results = RESULTS_DOC.read_text()
    data = {p.name: {t["id"]: t for t in json.loads(p.read_text())["tables"]} for p in DATA.glob("*.json")}
    checked = 0
    for text, anchor in re.findall(r"\[([^\]]+)\]\(DISPATCH-RESULTS\.md#([^)]+)\)", GUIDE.read_text()):
        figures = NUMBER.findall(text)
        if not figures:
            continue
        cells = set()
        for name, table_id in section_tables(results, anchor):
            table = data[name][table_id]
            for cell in [*table["columns"], *(c for row in table["rows"] for c in row)]:
                cells.update(NUMBER.findall(cell))
        missing = [f for f in figures if f not in cells]
        assert not missing, f"DISPATCH.md quotes {missing} in [{text}] but no table of #{anchor} holds them"
        checked += 1
    assert checked >= 10, f"only {checked} figures of the guide link to the results"


def test_the_links_between_the_guide_and_the_results_resolve():
    anchors = {p.name: {slug(t) for _, _, t in headings(p.read_text())} for p in (GUIDE, RESULTS_DOC)}
    broken = []
    for path in (GUIDE, RESULTS_DOC):
        for target, anchor in re.findall(r"\]\((DISPATCH(?:-RESULTS)?\.md)?#([^)]+)\)", path.read_text()):
            if anchor not in anchors[target or path.name]:
                broken.append(f"{path.name}: {target}#{anchor}")
    assert not broken, broken


def test_the_sections_the_code_and_docs_cite_exist():
    titles = {p.name: [re.sub(r"`", "", t).lower() for _, _, t in headings(p.read_text())]
              for p in (GUIDE, RESULTS_DOC)}
    cited, missing = 0, []
    files = [*ROOT.glob("dpboard/**/*.py"), *ROOT.glob("dpboard/**/*.c"), *ROOT.glob("tools/*.py"),
             *ROOT.glob("examples/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    for path in files:
        for file, title in CITATION.findall(path.read_text()):
            cited += 1
            if not any(t.startswith(title.replace("`", "").lower()) for t in titles[file]):
                missing.append(f"{path.relative_to(ROOT)}: {file}, {title!r}")
    assert cited >= 10 and not missing, missing


def cell_doc(name: str, lockstep_delayed_goodput: float) -> dict:
    """A sweep cell as ``run`` writes it, every row alike but the lockstep method's with the delayer."""
    labels = ["round_robin", "total_requests:cadence=sglang", "total_tokens:cadence=sglang", "vllm", "cache_aware",
              "dynamo_kv", "inflight_ttft:cadence=step", "inflight_lockstep:cadence=step"]
    summary = {"goodput_rps": 1.0, "ttft_p99_ms": 100.0, "ttft_p50_ms": 50.0, "tpot_p99_ms": 90.0,
               "tpot_p50_ms": 60.0, "idle_rank_step_share": 0.1, "extend_step_share": 0.5, "seed": 0}
    runs = {}
    for label in labels:
        runs[label] = [dict(summary)]
        runs[label + " +delayer"] = [dict(summary)]
    runs["inflight_lockstep:cadence=step +delayer"][0]["goodput_rps"] = lockstep_delayed_goodput
    # the wave: twice the goodput at three times the p99 TTFT, its requests held up to 1.5 s
    for label in ("inflight_wave:cadence=step", "inflight_wave:cadence=step +delayer"):
        runs[label] = [dict(summary, goodput_rps=2.0, ttft_p99_ms=300.0, goodput_share=0.5, held_p99_ms=1500.0)]
    trace, ranks, load = name.split("-")
    return {"cell": {"name": name, "trace": trace, "ranks": int(ranks), "load": float(load)}, "chunk": 512,
            "trace_info": {"0": {"independent_load": 0.82}}, "runs": runs, "wall_s": 12.0}


def test_collect_condenses_a_sweeps_cells_into_the_results_data(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "azure-16-0.9.json").write_text(json.dumps(cell_doc("azure-16-0.9", 0.5)))
    target = tmp_path / "lockstep-sweep.json"
    done = sweep("collect", "--out", str(out), "--results", str(target))
    assert done.returncode == 0, done.stderr
    results = json.loads(target.read_text())
    table, waves = results["tables"]
    assert table["id"] == "verdict" and table["columns"][0] == "cell"
    # the bar against the best rows (the wave's goodput, everyone else's p99): neither method has both
    assert waves["id"] == "wave-bar"
    (wave_row,) = waves["rows"]
    assert wave_row[:6] == ["azure-16-0.9", "yes", "**0.50**, 1.00", "**0.25**, 1.00", "1.00, **3.00**",
                            "1.00, **3.00**"]
    assert wave_row[6:] == ["0.0% / 50.0% / 50.0%", "1500", "no row", "inflight_wave", "round_robin"]
    (row,) = table["rows"]
    # equal to every reference without the delayer; half the goodput with it, in bold (below 0.99)
    assert row[:8] == ["azure-16-0.9", "1.00", "1.00", "1.00", "1.00", "**0.50**", "1.00", "without the delayer"]
    assert "1 cells" in results["source"] and results["collected"]
    printed = sweep("table", "--out", str(out), "--cells")
    assert printed.returncode == 0, printed.stderr
    assert "**Azure conversation, 16 ranks, load 0.9** (chunk 512, 0.82 of an independent rank's" in printed.stdout
    assert "| azure-16-0.9 | 1.00 | 1.00 | 1.00 | 1.00 | **0.50** | 1.00 | without the delayer |" in printed.stdout


def test_collect_without_cells_says_so(tmp_path):
    done = sweep("collect", "--out", str(tmp_path), "--results", str(tmp_path / "r.json"))
    assert done.returncode != 0 and "no cells in" in done.stderr and not (tmp_path / "r.json").exists()
