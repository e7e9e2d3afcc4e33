"""The floor plan of docs/design.md ("Layout") is the code's: every room it lists exists,
every module of posenc/ is in a room, and every import of posenc (at module level, in a
function, or for types only) points to a room on a lower floor or stays in its own room.
So there is no import cycle between rooms, and no function-level import that dodges one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import ROOT

PKG = ROOT / "posenc"


def floors() -> dict[str, tuple[int, str]]:
    """Name -> (floor, room), from the layout block of docs/design.md: lines ``<floor>
    <names>``, names ``x.py`` (a module) or ``x/`` (a package); several names on one
    line, separated by commas, are one room (named by the first)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Layout") :]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    rooms: dict[str, tuple[int, str]] = {}
    for line in block.splitlines():
        m = re.match(r"^(\d+)  (.+?)(?:\s{2,}|$)", line)
        if m:
            names = [n.strip().removesuffix(".py").removesuffix("/") for n in m.group(2).split(",")]
            for name in names:
                rooms[name] = (int(m.group(1)), names[0])
    return rooms


def room_of(module: str) -> str:
    """``posenc.tasks.lm_job`` -> ``tasks``; ``posenc.plots`` -> ``plots``."""
    return module.split(".")[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str) -> str | None:
    """The posenc module an imported name lives in (a module, or its package)."""
    parts = name.split(".")
    while parts:
        base = ROOT.joinpath(*parts)
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def imports(path: Path) -> list[tuple[str, int]]:
    """Every posenc module ``path`` imports, wherever the import statement is."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        for name in names:
            target = resolve(name) if name.startswith("posenc") else None
            if target and target != me:
                out.append((target, node.lineno))
    return out


def test_every_room_exists_and_every_module_has_a_room() -> None:
    plan = floors()
    assert len(plan) > 10, "the layout block of docs/design.md was not found"
    for room in plan:
        assert (PKG / f"{room}.py").exists() or (PKG / room).is_dir(), f"no posenc/{room}"
    for path in PKG.rglob("*.py"):
        if path.parent == PKG and path.name == "__init__.py":
            continue
        assert room_of(module_name(path)) in plan, f"{path.relative_to(ROOT)} has no floor"


def test_every_import_points_down_or_stays_in_its_room() -> None:
    plan = floors()
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        if me == "posenc":
            continue
        for target, line in imports(path):
            if target == "posenc":  # ``from posenc import x``: resolved to the package only
                continue
            (floor_a, a), (floor_b, b) = plan[room_of(me)], plan[room_of(target)]
            if a != b and floor_b >= floor_a:
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line} imports {target} "
                    f"(floor {floor_b}, room {b}) from floor {floor_a}"
                )
    assert not wrong, "\n".join(wrong)


#: Most function-level imports of posenc a module may hold: each keeps a heavy library
#: (torch, Lightning) off a path that does not need it; any other belongs at module level.
MAX_LAZY = 5


def lazy_imports(source: str) -> list[int]:
    """The lines of every import of posenc (absolute or relative) inside a function."""
    lines = set()  # a nested function's import is seen from each enclosing one
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                internal = any(a.name.split(".")[0] == "posenc" for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                internal = node.level > 0 or (node.module or "").split(".")[0] == "posenc"
            else:
                continue
            if internal:
                lines.add(node.lineno)
    return sorted(lines)


def test_few_function_level_imports() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PKG.rglob("*.py"))
        for line in lazy_imports(path.read_text())
    ]
    assert len(found) <= MAX_LAZY, (
        f"{len(found)} function-level imports of posenc (at most {MAX_LAZY}; "
        "move them to module level):\n" + "\n".join(found)
    )


def test_the_lazy_import_count_sees_relative_and_nested_imports() -> None:
    source = (
        "import posenc.files\n"
        "def f():\n    from . import files\n    def g():\n        import posenc.stop\n"
        "def h():\n    import json\n    from posenc_other import x\n"
    )
    assert lazy_imports(source) == [3, 5]


def test_the_check_sees_an_import_that_climbs() -> None:
    """The parser finds imports inside functions and relative ones (so the test above
    can fail)."""
    src = PKG / "eval" / "passkey.py"
    found = {t for t, _ in imports(src)}
    assert {"posenc.decoding.lm", "posenc.data.passkey", "posenc.model"} <= found
    plan = floors()
    assert plan["data"][0] < plan["eval"][0] < plan["tasks"][0]
