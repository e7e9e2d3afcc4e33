"""The floor plan of docs/design.md ("Layout") is the code's: every room it lists exists,
every module of posenc/ is in a room, and every import of posenc (at module level, in a
function, or for types only) points to a room on a lower floor or stays in its own room.
So there is no import cycle between rooms, and no function-level import that dodges one.
And the LM job's config, followed through the calls that pass it on, enters few modules
(:class:`Walk`)."""

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


# --- the config's walk: how far the run's config travels from the LM job ---

#: A config object's type: a group of :mod:`posenc.schema` (``("Run", "LMTask")``,
#: ``("Gate", None)``) or ``("Any", None)``: an untyped group (``encoder``, ``trainer``,
#: ``data``, ``paths``, ``tokenizer``, ``raw``: mappings).
Config = tuple[str, str | None]
#: Calls that hand back a group as a mapping (the same config in another shape).
CONVERSIONS = {"to_dict", "as_dict", "untyped", "to_container", "dict"}
Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class Walk:
    """Follows a config from one function through every call that passes it on.

    In a function, a name is config when it is a parameter bound to config, or a local
    (or ``self.x``) assigned from a config expression: a config name, an attribute chain
    of one that ends on a group (``cfg.task.eval``; ``cfg.task.seq_len`` is a plain value
    and is not followed, nor is a key of an untyped group), either arm of a conditional
    of such, or a group made a mapping (:data:`CONVERSIONS`: ``to_dict(cfg.encoder)``).

    A call with a config among its arguments (or as the receiver of a schema method) is
    resolved through the module's imports (``from posenc.x import f``,
    ``from posenc import x`` then ``x.f``, ``import posenc.x as y``, re-exports of a
    package, same-module functions, ``self.method``, ``super().method``; a class is its
    ``__init__``, found up its posenc bases) and the callee is walked with the matching
    parameters bound. A method that stores config on ``self`` has every method of its class
    walked with that attribute bound. Calls the walk cannot resolve (a method of an object
    of unknown type, a function passed as a value, ``instantiate``) are not followed."""

    def __init__(self, root: Path, package: str = "posenc") -> None:
        self.root, self.package = root, package
        self._trees: dict[str, ast.Module | None] = {}
        self.fields = self._schema_fields()

    # modules and names
    def is_module(self, name: str) -> bool:
        base = self.root.joinpath(*name.split("."))
        return base.with_suffix(".py").exists() or (base / "__init__.py").exists()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = self.root.joinpath(*module.split("."))
            path = (
                base.with_suffix(".py")
                if base.with_suffix(".py").exists()
                else base / "__init__.py"
            )
            self._trees[module] = ast.parse(path.read_text()) if path.exists() else None
        return self._trees[module]

    def bindings(self, module: str) -> dict[str, str]:
        """Name -> ``pkg.mod`` (a module) or ``pkg.mod:name`` (a definition) in ``module``."""
        tree = self.tree(module)
        if tree is None:
            return {}
        package = (
            module
            if self.root.joinpath(*module.split("."), "__init__.py").exists()
            else module.rpartition(".")[0]
        )
        out: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == self.package:
                        out[a.asname or a.name.split(".")[0]] = a.name if a.asname else self.package
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                if base.split(".")[0] != self.package:
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out[a.asname or a.name] = full if self.is_module(full) else f"{base}:{a.name}"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out[node.name] = f"{module}:{node.name}"
        return out

    def definition(self, target: str) -> tuple[str, Def] | None:
        """``pkg.mod:name`` or ``pkg.mod:Class.method`` -> (its module's name, its node),
        following re-exports and, for a method, the posenc bases of its class."""
        module, _, name = target.partition(":")
        head, _, method = name.partition(".")
        tree = self.tree(module)
        if tree is None:
            return None
        node = next(
            (
                n
                for n in tree.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and n.name == head
            ),
            None,
        )
        if node is None:  # a re-export
            bound = self.bindings(module).get(head)
            if bound is None or ":" not in bound or bound == target:
                return None
            return self.definition(bound + (f".{method}" if method else ""))
        if not method:
            return module, node
        if not isinstance(node, ast.ClassDef):
            return None
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == method:
                return module, item
        for base in bases(node):
            found = self.resolve(module, base)
            if found and ":" in found:
                hit = self.definition(f"{found}.{method}")
                if hit:
                    return hit
        return None

    def methods(self, cls: str) -> set[str]:
        """The names of the methods of class ``cls`` (``pkg.mod:Class``) and its posenc bases."""
        found = self.definition(cls)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return set()
        module, node = found
        names = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for base in bases(node):
            target = self.resolve(module, base)
            names |= self.methods(target) if target and ":" in target else set()
        return names

    def resolve(self, module: str, expr: ast.expr) -> str | None:
        """The module or definition a name or attribute chain names in ``module``."""
        if isinstance(expr, ast.Name):
            return self.bindings(module).get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.resolve(module, expr.value)
            if base is None:
                return None
            if ":" not in base:
                full = f"{base}.{expr.attr}"
                if self.is_module(full):
                    return full
                bound = self.bindings(base).get(expr.attr)
                return bound if bound else None
            return f"{base}.{expr.attr}"
        return None

    # the schema's types
    def _schema_fields(self) -> dict[str, dict[str, ast.expr]]:
        tree = self.tree(f"{self.package}.schema")
        out: dict[str, dict[str, ast.expr]] = {}
        for node in tree.body if tree else []:
            if isinstance(node, ast.ClassDef):
                out[node.name] = {
                    n.target.id: n.annotation
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
        return out

    def field(self, owner: Config, name: str) -> Config | None:
        """The config type of ``owner.name``, or None for a plain value."""
        annotation = self.fields.get(owner[0], {}).get(name)
        return self._config_type(annotation, owner[1]) if annotation is not None else None

    def _config_type(self, a: ast.expr, arg: str | None) -> Config | None:
        if isinstance(a, ast.BinOp):  # ``Gate | None``
            return self._config_type(a.left, arg) or self._config_type(a.right, arg)
        name = a.id if isinstance(a, ast.Name) else a.attr if isinstance(a, ast.Attribute) else ""
        if name == "T":
            return (arg, None) if arg else ("Any", None)
        if name == "Any":
            return ("Any", None)
        return (name, None) if name in self.fields and name != "Group" else None

    # one function
    def kind(self, expr: ast.expr, env: dict[str, Config]) -> Config | None:
        """The config type of ``expr`` in ``env``, or None when it is not config."""
        key = dotted(expr)
        if key in env:
            return env[key]
        if isinstance(expr, ast.Attribute):
            owner = self.kind(expr.value, env)
            return self.field(owner, expr.attr) if owner else None
        if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
            owner = self.kind(expr.value, env)
            return self.field(owner, str(expr.slice.value)) if owner else None
        if isinstance(expr, ast.IfExp):
            return self.kind(expr.body, env) or self.kind(expr.orelse, env)
        if isinstance(expr, ast.Call) and dotted(expr.func).rpartition(".")[2] in CONVERSIONS:
            receiver = expr.func.value if isinstance(expr.func, ast.Attribute) else None
            if any(self.kind(a, env) for a in expr.args) or (receiver and self.kind(receiver, env)):
                return ("Any", None)
        return None

    def environment(self, fn: Def, env: dict[str, Config]) -> dict[str, Config]:
        """``env`` and every local assigned from config, to a fixed point."""
        env = dict(env)
        while True:
            before = len(env)
            for node in ast.walk(fn):
                pairs: list[tuple[ast.expr, ast.expr]] = []
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                            pairs += list(zip(t.elts, node.value.elts, strict=False))
                        else:
                            pairs.append((t, node.value))
                elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                    pairs.append((node.target, node.value))
                for target, value in pairs:
                    key, found = dotted(target), self.kind(value, env)
                    if key and found and key not in env:
                        env[key] = found
            if len(env) == before:
                return env

    def walk(self, module: str, function: str, env: dict[str, Config]) -> dict[str, list[str]]:
        """Each module the config enters -> the calls by which it is first reached."""
        entered: dict[str, list[str]] = {}
        start = f"{module}:{function}"
        queue = [(start, env, [f"{start}({', '.join(env)})"])]
        seen: set[tuple[str, frozenset[tuple[str, Config]]]] = set()
        while queue:
            target, env, path = queue.pop(0)
            state = (target, frozenset(env.items()))
            found = self.definition(target)
            if state in seen or found is None:
                continue
            seen.add(state)
            where, fn = found
            entered.setdefault(where, path)
            if isinstance(fn, ast.ClassDef):  # no __init__ of its own (a dataclass)
                continue
            # The class whose ``self`` this is (a method may be defined in a base).
            cls = target.partition(":")[2].rpartition(".")[0]
            owner = f"{target.partition(':')[0]}:{cls}" if cls else ""
            local = self.environment(fn, env)
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                for callee, bound in self.calls(where, owner, call, local):
                    step = f"{callee}({', '.join(bound)})"
                    queue.append((callee, bound, [*path, step]))
            stored = {k: v for k, v in local.items() if k.startswith("self.")}
            if owner and stored:
                for name in self.methods(owner):
                    queue.append(
                        (f"{owner}.{name}", stored, [*path, f"{owner}.{name}({', '.join(stored)})"])
                    )
        return entered

    def calls(
        self, module: str, owner: str, call: ast.Call, env: dict[str, Config]
    ) -> list[tuple[str, dict[str, Config]]]:
        """The callee (``pkg.mod:name``) of ``call`` in ``module``, in a method of class
        ``owner`` (``pkg.mod:Class``; empty in a function), and its parameters bound to
        config."""
        func = call.func
        receiver: Config | None = None
        callee: str | None = None
        if isinstance(func, ast.Attribute):
            receiver = self.kind(func.value, env)
            if receiver and receiver[0] in self.fields:  # a method of a schema group
                callee = f"{self.package}.schema:{receiver[0]}.{func.attr}"
            elif isinstance(func.value, ast.Name) and func.value.id == "self" and owner:
                callee = f"{owner}.{func.attr}"
            elif isinstance(func.value, ast.Call) and dotted(func.value.func) == "super" and owner:
                cls = self.definition(owner)
                found = bases(cls[1]) if cls and isinstance(cls[1], ast.ClassDef) else []
                callee = next(
                    (
                        f"{b}.{func.attr}"
                        for b in (self.resolve(cls[0] if cls else module, x) for x in found)
                        if b and ":" in b
                    ),
                    None,
                )
        callee = callee or self.resolve(module, func)
        if callee is None or ":" not in callee:
            return []
        found = self.definition(callee)
        if found is None:
            return []
        if isinstance(found[1], ast.ClassDef):
            init = self.definition(f"{callee}.__init__")
            if init:
                callee, found = f"{callee}.__init__", init
        fn = found[1]
        args = [self.kind(a, env) for a in call.args]
        keywords = {k.arg: self.kind(k.value, env) for k in call.keywords if k.arg}
        if not any(args) and not any(keywords.values()) and not receiver:
            return []
        if isinstance(fn, ast.ClassDef):  # entered, with nothing of its own to walk
            given = next((t for t in [*args, *keywords.values()] if t), receiver)
            return [(callee, {"fields": given})] if given else []
        params = [p.arg for p in [*fn.args.posonlyargs, *fn.args.args]]
        method = "." in callee.partition(":")[2]
        bound: dict[str, Config] = {}
        if method and params:
            if receiver and callee.startswith(f"{self.package}.schema:"):
                bound[params[0]] = receiver
            params = params[1:]
        for name, kind in zip(params, args, strict=False):
            if kind:
                bound[name] = kind
        names = set(params) | {p.arg for p in fn.args.kwonlyargs}
        for name, kind in keywords.items():
            if kind and name in names:
                bound[name] = kind
        return [(callee, bound)] if bound else []


def bases(cls: ast.ClassDef) -> list[ast.expr]:
    """The bases of ``cls``, ``Base`` for ``Base[T]``."""
    return [b.value if isinstance(b, ast.Subscript) else b for b in cls.bases]


def dotted(expr: ast.expr) -> str:
    """``self.cfg`` for an attribute chain of names, ``cfg`` for a name, else ``""``."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = dotted(expr.value)
        return f"{base}.{expr.attr}" if base else ""
    return ""


#: Most posenc modules the LM job's config may enter (the job's own included): the job
#: reads its config and hands lower layers plain values or small purpose-built objects, so
#: a reader finds every config read in the job and few other places.
MAX_CONFIG_MODULES = 10


def test_the_lm_jobs_config_enters_few_modules() -> None:
    entered = Walk(ROOT).walk("posenc.tasks.lm_job", "run", {"cfg": ("Run", "LMTask")})
    report = "\n".join(f"{m}: {' -> '.join(p)}" for m, p in sorted(entered.items()))
    assert "posenc.tasks.lm_job" in entered, "the walk did not find posenc.tasks.lm_job:run"
    assert len(entered) <= MAX_CONFIG_MODULES, (
        f"the LM job's config enters {len(entered)} modules (at most {MAX_CONFIG_MODULES}; "
        "read it in the job and pass plain values):\n" + report
    )


def test_the_walk_follows_aliases_keywords_classes_and_self(tmp_path: Path) -> None:
    """The walk sees config passed by keyword to an aliased import, into a class that keeps
    it on ``self`` and hands it on from another method (so the test above can fail), and
    does not follow a plain value read from it."""
    files = {
        "__init__.py": "",
        "schema.py": "class Run:\n    seed: int\n    task: T\nclass Task:\n    seq_len: int\n"
        "    eval: Eval\nclass Eval:\n    n: int\n",
        "job.py": "from posenc import plain\nfrom posenc.mid import helper as h\n"
        "def run(cfg, run_dir):\n    t = cfg.task\n    plain.read(t.seq_len, cfg.seed)\n"
        "    h(1, group=t.eval)\n",
        "plain.py": "def read(n, seed):\n    return n\n",
        "mid.py": "from posenc.low import Reader\n"
        "def helper(n, *, group):\n    Reader(group).use()\n",
        "low.py": "import posenc.deep as d\nclass Reader:\n    def __init__(self, g):\n"
        "        self.g = g\n    def use(self):\n        d.deep(self.g)\n",
        "deep.py": "def deep(g):\n    return g.n\n",
    }
    (tmp_path / "posenc").mkdir()
    for name, text in files.items():
        (tmp_path / "posenc" / name).write_text(text)
    entered = Walk(tmp_path).walk("posenc.job", "run", {"cfg": ("Run", "Task")})
    assert sorted(entered) == ["posenc.deep", "posenc.job", "posenc.low", "posenc.mid"]
    assert entered["posenc.deep"] == [
        "posenc.job:run(cfg)",
        "posenc.mid:helper(group)",
        "posenc.low:Reader.__init__(g)",
        "posenc.low:Reader.use(self.g)",
        "posenc.deep:deep(g)",
    ]
