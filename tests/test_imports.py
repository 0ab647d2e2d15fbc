"""Import structure, read statically by scripts/import_graph.py: distributed wraps the
layers below it from outside, formats never imports kernels, no modules form a cycle, and
the directories whose imports were moved to module top stay within their budget of imports
inside functions, each with a comment saying why it is local."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
graph = sys.modules["import_graph"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(graph)

# imports not at module top, per module prefix (an optional dependency or a measured start-up cost each)
BUDGET = {
    "lowbit.checkpoint": 0,
    "lowbit.distributed": 0,
    "lowbit.config": 0,
    "lowbit.engine.paged_cache": 0,
    "lowbit.engine.llm": 0,
    "lowbit.engine.async_engine": 0,
    "lowbit.quantize": 0,
    "lowbit.formats": 0,
    "lowbit.server": 0,
    "lowbit.bench": 5,  # httpx and bench.serve (serve extra), hqq (peer quantizer), matplotlib, triton's timer
    "lowbit.cli": 1,  # lowbit.server.launch: fastapi / uvicorn (serve extra)
}
# packages under distributed in the map: none of them may import it
BELOW_DISTRIBUTED = ("lowbit.checkpoint", "lowbit.config", "lowbit.engine", "lowbit.models",
                     "lowbit.layers", "lowbit.kernels", "lowbit.formats", "lowbit.quantize")


@pytest.fixture(scope="module")
def imports() -> list:
    return graph.all_imports(ROOT / "lowbit")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_nothing_below_distributed_imports_it(imports):
    bad = [f"{i.module}:{i.line} -> {i.target}" for i in imports
           if _under(i.target, "lowbit.distributed") and any(_under(i.module, p) for p in BELOW_DISTRIBUTED)]
    assert not bad, "lowbit.distributed wraps these from outside; they must not import it:\n" + "\n".join(bad)


def test_checkpoint_knows_nothing_of_processes(imports):
    bad = [f"{i.module}:{i.line}" for i in imports
           if _under(i.module, "lowbit.checkpoint") and _under(i.target, "lowbit.distributed")]
    assert not bad


def test_formats_do_not_import_kernels(imports):
    """Arrows point down: kernels read the containers of lowbit.formats, never the reverse."""
    bad = [f"{i.module}:{i.line} -> {i.target}" for i in imports
           if _under(i.module, "lowbit.formats") and _under(i.target, "lowbit.kernels")]
    assert not bad, "lowbit.formats sits below lowbit.kernels; it must not import it:\n" + "\n".join(bad)


def test_no_import_cycle_anywhere(imports):
    edges = graph.graph([i for i in imports if _under(i.target, "lowbit")])
    assert graph.cycles(edges) == []


def test_at_most_25_imports_off_module_top(imports):
    count = sum(graph.indented_counts(imports).values())
    assert count <= 25, f"{count} imports are not at module top (scripts/import_graph.py --list)"


def test_no_import_cycle_inside_distributed(imports):
    edges = graph.graph([i for i in imports if _under(i.module, "lowbit.distributed")
                         and _under(i.target, "lowbit.distributed")])
    assert graph.cycles(edges) == []


def test_cycles_are_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert graph.cycles(edges) == [["a", "b", "c"]]
    assert graph.cycle_path(["a", "b", "c"], edges) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("prefix", sorted(BUDGET))
def test_local_imports_stay_within_budget_and_say_why(imports, prefix):
    local = [i for i in graph.statements(imports).values() if i.indented and _under(i.module, prefix)]
    where = [f"{i.module}:{i.line}" for i in local]
    assert len(local) <= BUDGET[prefix], f"imports not at module top under {prefix}: {where}"
    for imp in local:
        lines = (ROOT / "lowbit").parent.joinpath(*imp.module.split(".")).with_suffix(".py")
        if not lines.exists():
            lines = lines.with_suffix("") / "__init__.py"
        text = lines.read_text().splitlines()
        near = " ".join(text[max(0, imp.line - 4):imp.line]).lower()
        assert "imported here" in near, f"{imp.module}:{imp.line}: say why the import is local (# imported here: ...)"
