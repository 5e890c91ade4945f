"""The strict MSL check: metal/ parsed by clang under Metal's own rules.

Nothing on Linux compiles Metal, and the emulator (csrc/metal_emulator)
compiles the kernels as plain C++, which accepts what Metal rejects. This
check parses every ``metal/*.metal`` file, and the JIT source the extension
builds from each at run time (``mlx_knorm._native.ext.metal_kernel_source``),
with libclang and a model of Metal's language (``include/metal_stdlib``, the
only header it can reach: ``-nostdinc``, so the verdict is the same on every
machine), in two modes:

- ``msl3``: MSL 3.x, C++14 (``-std=c++14 -pedantic-errors -fno-exceptions
  -fno-rtti``), device, constant and threadgroup as distinct clang address
  spaces (constant also const) and thread the default one;
- ``metal4.1``: Metal 4.1's generic address space (Xcode 26.5, macOS 27 SDK),
  through clang's C++ for OpenCL 2021, the closest model clang has:
  unqualified pointers, references and ``this`` are generic.

Every kernel template is instantiated by its ``.metal`` file, so clang checks
each instantiation's body. On top of clang's diagnostics it checks what
Metal forbids and C++ allows: C++ that MSL lacks (double, long long, virtual
functions, exceptions, new and delete, thread_local, goto, ...), recursion,
a variable of static storage outside the constant address space, a kernel
pointer or reference parameter without an address space, threadgroup
variables outside a kernel's own scope, a declaration named with an MSL
keyword or a Metal library name, an attribute that MSL does not define, a
kernel's attributes against MSL's tables (interface.py), Metal 4.1's
-Wmetal-addr-spaces, a kernel template never instantiated, and a
threadgroup barrier in control flow not proven uniform (uniformity.py).

Two spellings of MSL that clang's C++ rejects are read as clang can read
them (``as_parsed``), and a third kept out of the model's way: attributes
on an explicit instantiation (``template [[host_name(n)]] [[kernel]] ...``,
knorm_defines.h's KNORM_KERNEL_INSTANCE) are dropped, since clang drops
an explicit instantiation it cannot parse and would check no kernel body;
a threadgroup array in a kernel's scope (KNORM_THREADGROUP_ARRAY) becomes a
threadgroup pointer from the model's ``knorm_msl_threadgroup_array``, whose
every use must lie in a kernel, since clang would reject the declaration
and with it the whole kernel template; and every other ``[[name(args)]]``
becomes an annotation, ``msl:name(args)``, that libclang reports on the
declaration it belongs to. The attributes' names are checked from the text
as written.

usage: python tests/msl/check.py [--metal-dir DIR] [--no-jit]
Needs the ``libclang`` wheel (the ``test`` extra). The JIT sources need the
built extension: without it (or with ``--no-jit``) the .metal files alone
are checked, and a line says so.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import clang.cindex as ci

import interface
import uniformity

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
METAL_DIR = ROOT / "metal"
MODEL_INCLUDE = HERE / "include"

COMMON_ARGS = [
    "-fsyntax-only",
    "-ferror-limit=0",
    "-D__METAL_VERSION__=310",
    # No host header: the verdict is the same on every machine, and a
    # kernel including one (<cmath>) fails as it does on a Mac.
    "-nostdinc",
    "-isystem",
    str(MODEL_INCLUDE),
    # An attribute that as_parsed does not turn into an annotation is
    # unknown to clang; check_attributes names it.
    "-Wno-unknown-attributes",
    # `constant const T*`, MSL's idiom, is const twice where the model's
    # constant is const.
    "-Wno-duplicate-decl-specifier",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    # knorm_defines.h declares every constant for every kernel source.
    "-Wno-unused-const-variable",
    "-Werror",
]
MODES = {
    "msl3": ["-x", "c++", "-std=c++14", "-pedantic-errors", "-fno-exceptions", "-fno-rtti", "-nostdinc++"],
    "metal4.1": ["-x", "clcpp", "-cl-std=clc++2021", "-cl-no-stdinc"],
}
# The address spaces of each mode, as libclang numbers them.
ADDRESS_SPACES = {
    "msl3": {"thread": 0, "device": 1, "constant": 2, "threadgroup": 3},
    "metal4.1": {"device": 1, "threadgroup": 2, "constant": 3, "thread": 4, "generic": 5},
}

# Keywords of MSL beyond C++14's (specification section 1.4 and 4-5).
MSL_KEYWORDS = frozenset({
    "half", "bfloat", "kernel", "vertex", "fragment", "compute", "device", "constant",
    "thread", "threadgroup", "threadgroup_imageblock", "ray_data", "object_data", "mesh",
    "object", "visible", "stage_in", "patch", "intersection",
})
# Names of the Metal library that a declaration of ours must not hide (the
# kernels are written under `using namespace metal`).
METAL_LIBRARY_NAMES = frozenset({
    "abs", "all", "any", "as_type", "bias", "ceil", "clamp", "cos", "cross", "ctz", "clz",
    "distance", "dot", "exp", "exp2", "extract_bits", "fast", "fabs", "floor", "fma", "fmax",
    "fmin", "fract", "gradient2d", "insert_bits", "isfinite", "isinf", "isnan", "length",
    "level", "log", "log2", "max", "min", "mix", "normalize", "popcount", "pow", "precise",
    "reverse_bits", "rint", "round", "rsqrt", "sampler", "saturate", "select", "sign", "sin",
    "smoothstep", "sqrt", "step", "tan", "trunc",
})
# C++14 that MSL does not have (specification section 1.4.1 and 2.1): its
# scalar types are bool, char, short, int, long, half, bfloat and float, and
# it has no exceptions, RTTI, dynamic memory, virtual functions, thread
# storage or goto. Tokens as parsed (a `= delete` function is MSL).
NOT_MSL_KEYWORDS = {
    "double": "MSL has no double (its scalar types: section 2.1)",
    "virtual": "MSL has no virtual functions",
    "throw": "MSL has no exceptions",
    "try": "MSL has no exceptions",
    "catch": "MSL has no exceptions",
    "new": "MSL has no new operator",
    "delete": "MSL has no delete operator",
    "typeid": "MSL has no run-time type identification",
    "dynamic_cast": "MSL has no dynamic_cast",
    "goto": "MSL has no goto",
    "register": "MSL has no register storage class",
    "thread_local": "MSL has no thread_local storage",
    "_Thread_local": "MSL has no thread_local storage",
    "__thread": "MSL has no thread_local storage",
    "__int128": "MSL has no 128-bit integer (its scalar types: section 2.1)",
    "wchar_t": "MSL has no wide characters (its scalar types: section 2.1)",
    "char16_t": "MSL has no wide characters (its scalar types: section 2.1)",
    "char32_t": "MSL has no wide characters (its scalar types: section 2.1)",
}
DECLARATION_KINDS = frozenset({
    ci.CursorKind.VAR_DECL, ci.CursorKind.PARM_DECL, ci.CursorKind.FIELD_DECL,
    ci.CursorKind.FUNCTION_DECL, ci.CursorKind.FUNCTION_TEMPLATE, ci.CursorKind.CXX_METHOD,
    ci.CursorKind.TYPEDEF_DECL, ci.CursorKind.TYPE_ALIAS_DECL, ci.CursorKind.STRUCT_DECL,
    ci.CursorKind.CLASS_DECL, ci.CursorKind.ENUM_DECL, ci.CursorKind.ENUM_CONSTANT_DECL,
    ci.CursorKind.TEMPLATE_TYPE_PARAMETER, ci.CursorKind.TEMPLATE_NON_TYPE_PARAMETER,
    ci.CursorKind.NAMESPACE,
})
FUNCTION_KINDS = frozenset({
    ci.CursorKind.FUNCTION_DECL, ci.CursorKind.FUNCTION_TEMPLATE, ci.CursorKind.CXX_METHOD,
    ci.CursorKind.CONSTRUCTOR, ci.CursorKind.DESTRUCTOR, ci.CursorKind.CONVERSION_FUNCTION,
})


@dataclass(frozen=True)
class Finding:
    unit: str  # the translation unit: a .metal file or "<name> (JIT)"
    mode: str
    where: str  # file:line:column
    message: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.mode}, {self.unit}] {self.message}"


def metal_sources(metal_dir: Path = METAL_DIR) -> dict[str, str]:
    """Every file of metal/, by name."""
    return {p.name: p.read_text() for p in sorted(metal_dir.iterdir()) if p.suffix in (".metal", ".h")}


def jit_sources(metal_dir: Path = METAL_DIR) -> dict[str, str]:
    """The text the extension hands Metal for each kernel (headers inlined,
    by csrc/common/kernel_source.cpp's metal_kernel_source). RuntimeError
    without the built extension."""
    try:
        from mlx_knorm import _native
    except ImportError as e:  # mlx_knorm, or MLX under it, not installed
        raise RuntimeError(f"the JIT sources need mlx_knorm's extension: {e}") from e
    if _native.ext is None:
        raise RuntimeError(f"the JIT sources need mlx_knorm's extension: {_native.load_error}")
    return {p.stem: _native.ext.metal_kernel_source(metal_dir, p.stem) for p in sorted(metal_dir.glob("*.metal"))}


THREADGROUP_ARRAY_DEFINITION = "#define KNORM_THREADGROUP_ARRAY(type, name, count) threadgroup type name[count]"
LONG_LONG_LITERAL = re.compile(r"[0-9][0-9a-fA-FxX']*(?:ll|LL)[uU]?|[0-9][0-9a-fA-FxX']*[uU](?:ll|LL)")
ATTRIBUTE_LIST = re.compile(r"\[\[(.*?)\]\]", re.S)
ATTRIBUTE_ITEM = re.compile(r"\s*(\w+)\s*(?:\((.*)\))?\s*", re.S)


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside parentheses."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def as_annotations(m: re.Match) -> str:
    """``[[a, b(x)]]`` as annotations that libclang reports
    (include/metal_stdlib's KNORM_MSL_ATTR); a list with anything else
    (``[[clang::...]]``) as written."""
    parts = []
    for item in split_top_level(m.group(1)):
        item_match = ATTRIBUTE_ITEM.fullmatch(item)
        if item_match is None:
            return m.group(0)
        name, args = item_match.groups()
        parts.append(f"annotate(KNORM_MSL_ATTR({name}))" if args is None
                     else f"annotate(KNORM_MSL_ATTR_ARGS({name}, {args}))")
    # As many lines as written, so that findings and marks keep their lines.
    return "__attribute__((" + ", ".join(parts) + "))" + "\n" * m.group(0).count("\n")


def as_parsed(text: str) -> str:
    """The text clang parses (the module's docstring says why)."""
    text = re.sub(r"\btemplate\s+(?:\[\[[^\]]*\]\]\s*)+(?=decltype)", "template ", text)
    text = text.replace(THREADGROUP_ARRAY_DEFINITION,
                        "#define KNORM_THREADGROUP_ARRAY(type, name, count) "
                        "threadgroup type* name = knorm_msl_threadgroup_array<type, count>()")
    return ATTRIBUTE_LIST.sub(as_annotations, text)


class Unit:
    """One translation unit parsed in one mode, and its checks."""

    def __init__(self, index: ci.Index, name: str, main: str, files: dict[str, str], mode: str,
                 include: Path | None):
        self.name = name
        self.mode = mode
        self.spaces = ADDRESS_SPACES[mode]
        self.files = files
        args = [*MODES[mode], *COMMON_ARGS]
        if include is not None:
            args += ["-I", str(include)]
        unsaved = [(path, as_parsed(text)) for path, text in files.items()]
        self.tu = index.parse(main, args=args, unsaved_files=unsaved)
        self.findings: list[Finding] = []
        # Every cursor of our files, once (walking the AST is the cost).
        self.cursors = [c for top in self.tu.cursor.get_children() if self.ours(top) for c in top.walk_preorder()]

    def add(self, location: ci.SourceLocation | None, message: str) -> None:
        where = f"{location.file.name}:{location.line}:{location.column}" if location and location.file else self.name
        self.findings.append(Finding(self.name, self.mode, where, message))

    def ours(self, cursor: ci.Cursor) -> bool:
        return cursor.location.file is not None and cursor.location.file.name in self.files

    def run(self) -> list[Finding]:
        kernels = [c for c in self.cursors if interface.is_kernel(c)]
        self.check_diagnostics(kernels)
        self.check_language()
        self.check_declarations(kernels)
        self.check_recursion()
        self.check_attributes()
        self.check_interfaces(kernels)
        self.check_member_calls()
        self.check_instantiated(kernels)
        uniformity.check_barriers(self.cursors, self.ours, self.files, self.add)
        return self.findings

    def check_diagnostics(self, kernels: list[ci.Cursor]) -> None:
        for d in self.tu.diagnostics:
            if d.severity < ci.Diagnostic.Error:
                continue
            self.add(d.location, d.spelling)
        for c in self.cursors:
            if (c.kind == ci.CursorKind.CALL_EXPR and c.spelling == "knorm_msl_threadgroup_array"
                    and not any(self.encloses(k, c.location) for k in kernels)):
                self.add(c.location, "threadgroup memory declared outside a kernel's scope")

    @staticmethod
    def encloses(cursor: ci.Cursor, location: ci.SourceLocation) -> bool:
        start, end = cursor.extent.start, cursor.extent.end
        return (location.file is not None and start.file is not None
                and location.file.name == start.file.name and start.line <= location.line <= end.line)

    def check_declarations(self, kernels: list[ci.Cursor]) -> None:
        for c in self.cursors:
            if c.kind not in DECLARATION_KINDS:
                continue
            if c.spelling in MSL_KEYWORDS or c.spelling == "knorm_msl_bfloat":
                keyword = "bfloat" if c.spelling == "knorm_msl_bfloat" else c.spelling
                self.add(c.location, f"'{keyword}' is an MSL keyword and cannot name a declaration")
            elif c.spelling in METAL_LIBRARY_NAMES:
                self.add(c.location, f"'{c.spelling}' hides the Metal library's {c.spelling}")
            if c.kind == ci.CursorKind.VAR_DECL and self.static_storage(c):
                if c.type.get_address_space() != self.spaces["constant"]:
                    self.add(c.location, f"'{c.spelling}' has static storage outside the constant address space")
        for k in kernels:
            if k.result_type.spelling != "void":
                self.add(k.location, f"kernel '{k.spelling}' must return void")
            for p in k.get_children():
                if p.kind != ci.CursorKind.PARM_DECL:
                    continue
                t = p.type
                if t.kind in (ci.TypeKind.POINTER, ci.TypeKind.LVALUEREFERENCE):
                    space = t.get_pointee().get_address_space()
                    if space not in (self.spaces["device"], self.spaces["constant"], self.spaces["threadgroup"]):
                        self.add(p.location, f"kernel parameter '{p.spelling}' names no device, constant or "
                                             "threadgroup address space")

    @staticmethod
    def static_storage(c: ci.Cursor) -> bool:
        parent = c.semantic_parent
        at_namespace = parent is not None and parent.kind in (ci.CursorKind.TRANSLATION_UNIT, ci.CursorKind.NAMESPACE)
        return at_namespace or c.storage_class == ci.StorageClass.STATIC

    def check_recursion(self) -> None:
        """MSL has no recursion: no cycle in the call graph of the
        definitions (templates as one node each)."""
        calls: dict[str, set[str]] = {}
        where: dict[str, ci.Cursor] = {}
        for f in self.cursors:
            if f.kind not in FUNCTION_KINDS or not f.is_definition():
                continue
            node = self.node(f)
            where.setdefault(node, f)
            callees = calls.setdefault(node, set())
            for c in f.walk_preorder():
                for target in self.targets(c):
                    if self.ours(target):
                        callees.add(self.node(target))
        state: dict[str, int] = {}  # 1 on the stack, 2 done

        def visit(node: str, stack: list[str]) -> None:
            state[node] = 1
            stack.append(node)
            for callee in sorted(calls.get(node, ())):
                if state.get(callee) == 1:
                    cycle = stack[stack.index(callee):] + [callee]
                    names = " -> ".join(where[n].spelling if n in where else n for n in cycle)
                    self.add(where[callee].location if callee in where else None, f"recursion: {names}")
                elif callee not in state:
                    visit(callee, stack)
            stack.pop()
            state[node] = 2

        for node in sorted(calls):
            if node not in state:
                visit(node, [])

    @staticmethod
    def targets(c: ci.Cursor) -> list[ci.Cursor]:
        if c.kind == ci.CursorKind.OVERLOADED_DECL_REF:
            lib = ci.conf.lib
            return [lib.clang_getOverloadedDecl(c, i) for i in range(lib.clang_getNumOverloadedDecls(c))]
        if c.kind in (ci.CursorKind.CALL_EXPR, ci.CursorKind.DECL_REF_EXPR, ci.CursorKind.MEMBER_REF_EXPR):
            r = c.referenced
            if r is not None and r.kind in FUNCTION_KINDS:
                return [r]
        return []

    @staticmethod
    def node(f: ci.Cursor) -> str:
        template = ci.conf.lib.clang_getSpecializedCursorTemplate(f)
        if template is not None and not template.kind.is_invalid():
            f = template
        return f.canonical.get_usr() or f.displayname

    def check_attributes(self) -> None:
        """Every attribute's name, as written."""
        for path, text in self.files.items():
            for m in re.finditer(r"\[\[(.*?)\]\]|KNORM_ATTRIBUTE\(\s*(\w+)\s*\)", text):
                names = [m.group(2)] if m.group(2) else re.findall(r"(?:^|,)\s*(\w+)", re.sub(r"\([^()]*\)", "", m.group(1)))
                for name in names:
                    if name not in interface.MSL_ATTRIBUTES and name not in ("name", "index"):  # macro parameters
                        line = text.count("\n", 0, m.start()) + 1
                        self.findings.append(Finding(self.name, self.mode, f"{path}:{line}",
                                                     f"unknown MSL attribute '{name}'"))

    def space_of(self, t: ci.Type) -> str | None:
        """The address space a pointer or reference type points into, by
        MSL's name (None for thread memory, generic, or not a pointer)."""
        if t.kind not in (ci.TypeKind.POINTER, ci.TypeKind.LVALUEREFERENCE):
            return None
        space = t.get_pointee().get_address_space()
        return next((name for name, number in self.spaces.items()
                     if number == space and name in ("device", "constant", "threadgroup")), None)

    def check_interfaces(self, kernels: list[ci.Cursor]) -> None:
        for k in kernels:
            interface.check_kernel(k, self.space_of, self.add)
        for f in self.cursors:
            if f.kind in FUNCTION_KINDS and not interface.is_kernel(f):
                interface.check_helper(f, self.add)

    def tokens(self):
        """The tokens of our declarations as parsed (not those of a
        preprocessor branch not taken between them)."""
        for top in self.tu.cursor.get_children():
            if self.ours(top):
                yield from top.get_tokens()

    def check_language(self) -> None:
        """C++ that MSL does not have and clang accepts."""
        previous = None
        for token in self.tokens():
            word = token.spelling
            reason = NOT_MSL_KEYWORDS.get(word)
            if word == "delete" and previous == "=":
                reason = None  # a deleted function
            elif word == "long" and previous == "long":
                reason = "MSL has no long long (its scalar types: section 2.1)"
            elif word == "double" and previous == "long":
                reason = "MSL has no long double (its scalar types: section 2.1)"
            elif token.kind == ci.TokenKind.LITERAL and LONG_LONG_LITERAL.fullmatch(word):
                reason = "MSL has no long long literal (its scalar types: section 2.1)"
            if reason is not None and (token.kind != ci.TokenKind.IDENTIFIER or word.startswith("__")):
                self.add(token.location, f"'{word}': {reason}")
            previous = word

    def check_member_calls(self) -> None:
        """Metal 4.1's -Wmetal-addr-spaces: a member function without an
        address-space qualifier (generic `this`) called through an object in
        device, threadgroup or constant memory (MSL 3 rejects such a call:
        there `this` is thread)."""
        if self.mode != "metal4.1":
            return
        for c in self.cursors:
            if c.kind != ci.CursorKind.MEMBER_REF_EXPR:
                continue
            method = c.referenced
            if (method is None or method.kind != ci.CursorKind.CXX_METHOD or method.is_static_method()
                    or not method.type.spelling.endswith("__generic")):
                continue
            objects = list(c.get_children())
            if not objects:
                continue  # through `this`, whose space the caller's qualifier gives
            object_expr = objects[0]
            while object_expr.kind == ci.CursorKind.UNEXPOSED_EXPR and list(object_expr.get_children()):
                object_expr = next(object_expr.get_children())
            spelled = object_expr.type.spelling
            if object_expr.type.kind == ci.TypeKind.POINTER:
                spelled = object_expr.type.get_pointee().spelling
            space = next((msl for opencl, msl in (("__global", "device"), ("__local", "threadgroup"),
                                                  ("__constant", "constant")) if opencl in spelled), None)
            if space is not None:
                self.add(c.location, f"'{c.spelling}' has no address-space qualifier and is called through "
                                     f"{space} memory (-Wmetal-addr-spaces): qualify it")

    def check_instantiated(self, kernels: list[ci.Cursor]) -> None:
        """Each kernel template is instantiated in this unit, so that clang
        checked its body for some arguments."""
        text = "\n".join(as_parsed(t) for t in self.files.values())
        for k in kernels:
            if k.kind == ci.CursorKind.FUNCTION_TEMPLATE and not re.search(
                    r"KNORM_KERNEL_INSTANCE\([^;]*\b" + re.escape(k.spelling) + r"\s*<", text):
                self.add(k.location, f"kernel template '{k.spelling}' is never instantiated")


def includes(name: str, texts: dict[str, str]) -> set[str]:
    """The files of metal/ that `name` includes, directly or not, and itself."""
    found, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in found or current not in texts:
            continue
        found.add(current)
        todo += re.findall(r'^#include "([^"]+)"', texts[current], re.M)
    return found


def check(metal_dir: Path = METAL_DIR, *, sources: dict[str, str] | None = None,
          jit: dict[str, str] | None = None, files: bool = True, modes=tuple(MODES)) -> list[Finding]:
    """Every .metal file of metal_dir with its headers (unless not
    ``files``; ``sources`` overrides files by name, and then only the
    .metal files that reach one of them are checked) and every JIT source
    given, in every mode."""
    texts = metal_sources(metal_dir)
    texts.update(sources or {})
    index = ci.Index.create()
    findings: list[Finding] = []
    root = metal_dir.resolve()
    by_path = {str(root / name): text for name, text in texts.items()}
    units = sorted(n for n in texts if n.endswith(".metal") and files)
    if sources:
        units = [n for n in units if includes(n, texts) & set(sources)]
    for name in units:
        for mode in modes:
            findings += Unit(index, name, str(root / name), by_path, mode, root).run()
    for name, text in sorted((jit or {}).items()):
        path = str(root / f"{name}.jit.metal")
        for mode in modes:
            findings += Unit(index, f"{name} (JIT)", path, {path: text}, mode, None).run()
    return sorted(set(findings), key=str)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metal-dir", type=Path, default=METAL_DIR)
    parser.add_argument("--no-jit", action="store_true", help="skip the JIT sources (they need the extension)")
    args = parser.parse_args(argv)
    jit = None
    if not args.no_jit:
        try:
            jit = jit_sources(args.metal_dir)
        except RuntimeError as e:
            print(f"strict MSL check: JIT sources not checked ({e}); checking the .metal files")
    findings = check(args.metal_dir, jit=jit)
    for f in findings:
        print(f)
    units = len(list(args.metal_dir.glob("*.metal"))) * (1 if jit is None else 2)
    print(f"strict MSL check: {units} translation units x {len(MODES)} modes, {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
