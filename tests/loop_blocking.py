"""A static check for blocking calls on an event loop: what an ``async def`` runs before its next ``await``.

From every ``async def`` in the modules checked, it follows the calls the loop itself would run: the calls in
the function's body (a call's arguments included, a nested ``def`` or ``lambda`` not: those run where they are
handed, an executor or a thread), into every function of the package it can resolve without running anything:

- ``helper()`` and ``module.helper()``: a function of the same module, or one imported from the package
  (re-exports through a package's ``__init__`` followed);
- ``self.method()``, and ``self.attr.method()`` where the class says what ``attr`` holds: a class-level
  annotation, ``self.attr: T``, ``self.attr = T(...)``, or ``self.attr = param`` with ``param: T``;
- ``param.method()`` where the parameter is annotated with a class of the package.

A call it cannot resolve (a local variable's method, a callback, a protocol) is not followed; ruff's ASYNC2
rules and the runtime check (asyncio debug mode) cover what this cannot see. A call is blocking when its
qualified name is in ``BLOCKING`` or, whatever the receiver, its method name is in ``BLOCKING_METHODS``;
a call that is awaited is not (``await event.wait()``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCKING = {  # qualified callee -> why it blocks the loop
    "time.sleep": "sleeps the thread",
    "open": "file I/O",
    "io.open": "file I/O",
    "os.fsync": "file I/O",
    "json.load": "reads a file",
    "json.dump": "writes a file",
    "shutil.copyfile": "file I/O",
    "shutil.copy": "file I/O",
    "shutil.move": "file I/O",
    "shutil.rmtree": "file I/O",
    "subprocess.run": "waits for a process",
    "subprocess.call": "waits for a process",
    "subprocess.check_call": "waits for a process",
    "subprocess.check_output": "waits for a process",
    "os.system": "waits for a process",
    "os.waitpid": "waits for a process",
    "urllib.request.urlopen": "synchronous HTTP",
    "requests.get": "synchronous HTTP",
    "requests.post": "synchronous HTTP",
    "requests.request": "synchronous HTTP",
    "zlib.compress": "compression (CPU-bound)",
    "zlib.decompress": "decompression (CPU-bound)",
    "zstandard.compress": "zstd compression (CPU-bound)",
    "zstandard.decompress": "zstd decompression (CPU-bound)",
    "edgedecode.kv.wire.writer.encode_payload": "EDKV encoding: quantizes and zstd-compresses a whole KV",
    "edgedecode.kv.wire.reader.decode_snapshot": "EDKV decoding: decompresses and dequantizes a whole KV",
    "edgedecode.kv.wire.reader.EDKVReader.feed": "EDKV decoding: verifies, decompresses and dequantizes chunks",
}
BLOCKING_METHODS = {  # a method of any receiver, by name -> why it blocks the loop
    "compress": "compression (zstandard, zlib: CPU-bound)",
    "decompress": "decompression (zstandard, zlib: CPU-bound)",
    "read_text": "file I/O (pathlib)",
    "write_text": "file I/O (pathlib)",
    "read_bytes": "file I/O (pathlib)",
    "write_bytes": "file I/O (pathlib)",
    "communicate": "waits for a process",
}
MAX_DEPTH = 12  # calls followed from an async def
OFF_LOOP = {"run_in_executor", "to_thread", "submit", "Thread", "Process"}  # run what they are handed elsewhere

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Finding:
    """A blocking call the loop runs: in ``file``'s ``async def`` ``function``, through ``chain``."""

    file: str  # relative to the checked root, as in the allow-list
    function: str  # the async def's qualified name in its module (Class.method)
    call: str  # the blocking callee, as BLOCKING or BLOCKING_METHODS names it (".compress" for a method)
    reason: str
    chain: tuple[str, ...]  # the functions followed, from the async def to the one that makes the call

    def __str__(self) -> str:
        return f"{self.file}: async {self.function} -> {' -> '.join(self.chain[1:] + (self.call,))} ({self.reason})"


@dataclass
class _Class:
    module: str
    node: ast.ClassDef
    methods: dict[str, Function] = field(default_factory=dict)
    attributes: dict[str, str] = field(default_factory=dict)  # self.<name> -> qualified class name
    bases: list[str] = field(default_factory=list)


@dataclass
class _Module:
    name: str
    file: Path
    imports: dict[str, str] = field(default_factory=dict)  # local name -> qualified name
    functions: dict[str, Function] = field(default_factory=dict)
    classes: dict[str, _Class] = field(default_factory=dict)


class _Index:
    """Every module of a package, parsed: imports, functions, classes and what their attributes hold."""

    def __init__(self, root: Path, package: str) -> None:
        self.root = root
        self.modules: dict[str, _Module] = {}
        for file in sorted((root / package).rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.modules[name] = self._module(name, file, parts[-1] == "__init__")
        for module in self.modules.values():  # once every class is known: what their attributes hold
            for cls in module.classes.values():
                self._attributes(module, cls)

    def _module(self, name: str, file: Path, is_package: bool) -> _Module:
        tree = ast.parse(file.read_text(), str(file))
        module = _Module(name, file)
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module.imports[alias.asname or alias.name.partition(".")[0]] = (
                        alias.name if alias.asname else alias.name.partition(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
        module.functions = _functions(tree.body)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [q for b in node.bases if (q := self.qualify(module, b))]
                module.classes[node.name] = _Class(module.name, node, _functions(node.body), bases=bases)
        return module

    def _attributes(self, module: _Module, info: _Class) -> None:
        for item in info.node.body:
            held = self.annotation(module, item.annotation) if isinstance(item, ast.AnnAssign) else None
            if held is not None and isinstance(item.target, ast.Name):  # a dataclass field, a declared attribute
                info.attributes[item.target.id] = held
        for method in info.methods.values():
            params = {a.arg: a.annotation for a in method.args.args + method.args.kwonlyargs if a.annotation}
            for statement in ast.walk(method):
                target, value, annotation = _self_assignment(statement)
                if target is None:
                    continue
                held = self.annotation(module, annotation) if annotation is not None else None
                if held is None and isinstance(value, ast.Call):
                    held = self.qualify(module, value.func)
                if held is None and isinstance(value, ast.Name) and value.id in params:
                    held = self.annotation(module, params[value.id])
                if held is not None and self.find_class(held) is not None:
                    info.attributes.setdefault(target, held)

    def qualify(self, module: _Module, node: ast.expr) -> str | None:
        """The qualified name an expression (``name`` or ``a.b.c``) refers to in ``module``, if it is a name."""
        if isinstance(node, ast.Name):
            if node.id in module.imports:
                return module.imports[node.id]
            if node.id in module.functions or node.id in module.classes:
                return f"{module.name}.{node.id}"
            return node.id  # a builtin or a local: named as is
        if isinstance(node, ast.Attribute) and (base := self.qualify(module, node.value)) is not None:
            return f"{base}.{node.attr}"
        return None

    def annotation(self, module: _Module, node: ast.expr | None) -> str | None:
        """The package class an annotation names (``T``, ``T | None``, ``Optional[T]``, ``"T"``), if one."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self.annotation(module, ast.parse(node.value, mode="eval").body)
        if isinstance(node, ast.BinOp):
            return self.annotation(module, node.left) or self.annotation(module, node.right)
        if isinstance(node, ast.Subscript):
            return self.annotation(module, node.slice)
        name = self.qualify(module, node)
        return name if name is not None and self.find_class(name) is not None else None

    def canonical(self, qualified: str) -> str:
        """Where a package name is defined, through re-exports: ``edgedecode.kv.wire.encode_payload`` is
        ``edgedecode.kv.wire.writer.encode_payload``."""
        for _ in range(8):
            module_name, _, attr = qualified.rpartition(".")
            module = self.modules.get(module_name)
            if module is None or attr not in module.imports:
                break
            qualified = module.imports[attr]
        return qualified

    def find_class(self, qualified: str) -> _Class | None:
        module_name, _, attr = self.canonical(qualified).rpartition(".")
        module = self.modules.get(module_name)
        return module.classes.get(attr) if module else None

    def find_function(self, qualified: str) -> tuple[_Module, Function] | None:
        module_name, _, attr = self.canonical(qualified).rpartition(".")
        module = self.modules.get(module_name)
        return (module, module.functions[attr]) if module and attr in module.functions else None

    def method(self, qualified_class: str, name: str) -> tuple[_Module, Function] | None:
        """``name`` of the class or, where it does not define it, of its package bases."""
        cls = self.find_class(qualified_class)
        if cls is None:
            return None
        if name in cls.methods:
            return self.modules[cls.module], cls.methods[name]
        for base in cls.bases:
            if found := self.method(base, name):
                return found
        return None

    def attribute(self, qualified_class: str, name: str) -> str | None:
        cls = self.find_class(qualified_class)
        if cls is None:
            return None
        return cls.attributes.get(name) or next((a for b in cls.bases if (a := self.attribute(b, name))), None)


def _self_assignment(node: ast.AST) -> tuple[str | None, ast.expr | None, ast.expr | None]:
    """(attribute, value, annotation) of ``self.attribute[: annotation] = value``; (None, None, None) otherwise."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, value, annotation = node.targets[0], node.value, None
    elif isinstance(node, ast.AnnAssign):
        target, value, annotation = node.target, node.value, node.annotation
    else:
        return None, None, None
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return target.attr, value, annotation
    return None, None, None


def _functions(body: list[ast.stmt]) -> dict[str, Function]:
    return {node.name: node for node in body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def _typed_names(function: Function) -> dict[str, ast.expr]:
    """What a function's parameters and locals hold, where it says: ``p: T``, ``x: T = ...`` or ``x = T(...)``
    (each an expression that ``_Index.annotation`` resolves to a package class, or to nothing)."""
    held = {a.arg: a.annotation for a in function.args.args + function.args.kwonlyargs if a.annotation}
    for node in ast.walk(function):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            held.setdefault(node.target.id, node.annotation)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
        ):
            held.setdefault(node.targets[0].id, node.value.func)
    return held


def _runs(body: list[ast.stmt]) -> Iterator[tuple[ast.expr, ast.Call | None, bool]]:
    """What the body runs itself: (callee, its call or None, awaited) for every call, and for every function
    referenced and not handed to an executor or a thread (``for rung in (self._a, self._b): rung()``, a
    property, a key function: the loop may run it). Nested defs, lambdas and classes are left out."""
    awaited: set[int] = set()
    stack: list[tuple[ast.AST, bool]] = [(node, False) for node in reversed(body)]
    while stack:
        node, off_loop = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Await) and isinstance(node.value, ast.Call):
            awaited.add(id(node.value))
        if isinstance(node, ast.Call):
            yield node.func, node, id(node) in awaited
            handed = _callee_name(node.func) in OFF_LOOP or (
                isinstance(node.func, ast.Attribute) and node.func.attr == "map"  # an executor's map
            )
            arguments = [*node.args, *(k.value for k in node.keywords)]
            stack += [(child, off_loop or handed) for child in reversed(arguments)]
            stack += [(child, off_loop) for child in ast.walk(node.func) if isinstance(child, ast.Call)]
            continue
        if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
            if not off_loop:
                yield node, None, False
            if isinstance(node, ast.Attribute):
                stack += [(child, off_loop) for child in ast.walk(node.value) if isinstance(child, ast.Call)]
            continue
        stack += [(child, off_loop) for child in reversed(list(ast.iter_child_nodes(node)))]


def _callee_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


Target = tuple[_Module, _Class | None, Function]  # a function the loop runs: its module, its class, its def


class _Checker:
    def __init__(self, index: _Index, wanted: list[Path]) -> None:
        self.index = index
        self.wanted = wanted

    def checked(self, module: _Module) -> bool:
        """Whether the module's async defs are checked (it is one of the files, or under one of the folders)."""
        return any(module.file == w or w in module.file.parents for w in self.wanted)

    def check(self, module: _Module, cls: _Class | None, function: ast.AsyncFunctionDef) -> Iterator[Finding]:
        """The blocking calls of one async def, each once, with the first chain that reaches it."""
        qualname = f"{cls.node.name}.{function.name}" if cls else function.name
        file = module.file.relative_to(self.index.root).as_posix()
        seen: set[int] = {id(function)}
        found: dict[str, Finding] = {}
        stack = [(module, cls, function, (qualname,))]
        while stack:
            here, owner, node, chain = stack.pop()
            names = _typed_names(node)
            nested = _functions(node.body)
            for callee, call, awaited in _runs(node.body):
                if isinstance(callee, ast.Name) and callee.id in nested:  # a local helper, called or referenced
                    target = (here, owner, nested[callee.id])
                else:
                    target = self._resolve(here, owner, names, callee)
                label, reason = self._blocking(here, call, target) if call is not None else (None, "")
                if label is not None and not awaited:
                    found.setdefault(label, Finding(file, qualname, label, reason, chain))
                    continue  # what it calls in turn blocks as part of it
                if target is None or len(chain) >= MAX_DEPTH:
                    continue
                callee_module, callee_class, callee = target
                if isinstance(callee, ast.AsyncFunctionDef) and self.checked(callee_module):
                    continue  # checked on its own: its findings are its own
                if id(callee) not in seen:
                    seen.add(id(callee))
                    name = f"{callee_class.node.name}.{callee.name}" if callee_class else callee.name
                    stack.append((callee_module, callee_class, callee, (*chain, name)))
        yield from found.values()

    def _blocking(self, module: _Module, call: ast.Call, target: Target | None) -> tuple[str | None, str]:
        """(label, reason) of a blocking call: by its name, by the function it resolves to, or by its method's
        name; (None, "") for any other."""
        name = self.index.qualify(module, call.func)
        name = self.index.canonical(name) if name else None
        if target is not None:
            target_module, target_class, function = target
            owner = f"{target_class.node.name}." if target_class else ""
            name = name if name in BLOCKING else f"{target_module.name}.{owner}{function.name}"
        if name in BLOCKING:
            return name, BLOCKING[name]
        if isinstance(call.func, ast.Attribute) and call.func.attr in BLOCKING_METHODS:
            return f".{call.func.attr}", BLOCKING_METHODS[call.func.attr]
        return None, ""

    def _resolve(
        self, module: _Module, owner: _Class | None, names: dict[str, ast.expr], func: ast.expr
    ) -> Target | None:
        """(module, class or None, function) that ``func`` calls, where the package says which."""
        index = self.index
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            receiver = func.value.id
            held = (
                f"{owner.module}.{owner.node.name}"
                if receiver == "self" and owner is not None
                else index.annotation(module, names.get(receiver))
            )
            if held is not None:
                return self._method(held, func.attr)
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Attribute)
            and isinstance(func.value.value, ast.Name)
            and func.value.value.id == "self"
            and owner is not None
            and (held := index.attribute(f"{owner.module}.{owner.node.name}", func.value.attr))
        ):
            return self._method(held, func.attr)
        name = index.qualify(module, func)
        found = index.find_function(name) if name else None
        return (found[0], None, found[1]) if found else None

    def _method(self, qualified_class: str, name: str) -> Target | None:
        found = self.index.method(qualified_class, name)
        if found is None:
            return None
        module, node = found
        cls = next(c for c in module.classes.values() if node in c.methods.values())
        return module, cls, node


def find_blocking(root: Path, package: str, files: list[str]) -> list[Finding]:
    """The blocking calls the ``async def``s of ``files`` (paths under ``root``, folders included) run on
    their loop, following calls through ``package`` (a folder under ``root``)."""
    index = _Index(root, package)
    checker = _Checker(index, [root / f for f in files])
    findings = []
    for module in index.modules.values():
        if not checker.checked(module):
            continue
        for node in module.functions.values():
            if isinstance(node, ast.AsyncFunctionDef):
                findings += checker.check(module, None, node)
        for cls in module.classes.values():
            for node in cls.methods.values():
                if isinstance(node, ast.AsyncFunctionDef):
                    findings += checker.check(module, cls, node)
    return findings
