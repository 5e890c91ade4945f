"""A kernel's interface against MSL's tables (specification section 5.2):
the attributes of a kernel and of its parameters, their arguments and the
types they attach to.

check.py's as_parsed turns each ``[[name(args)]]`` into an annotation,
``msl:name(args)``, which libclang reports on the declaration it belongs
to; a kernel is a function with the annotation ``msl:kernel``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import clang.cindex as ci

# Resource attributes: the argument table each indexes and its index range
# (section 5.2.1: 31 buffers, 31 threadgroup buffers, 128 textures, 16
# samplers), and the address spaces of the pointer or reference each takes.
RESOURCE_INDICES = {"buffer": 31, "threadgroup": 31, "texture": 128, "sampler": 16}
RESOURCE_SPACES = {"buffer": ("device", "constant"), "threadgroup": ("threadgroup",)}
# Thread attributes (section 5.2.3.6). A position is ushort or uint, or a 2-
# or 3-component vector of them, and a kernel's positions all have one
# width; an index or count is a ushort or uint scalar.
POSITION_ATTRIBUTES = frozenset({
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threads_per_grid", "threads_per_threadgroup", "threadgroups_per_grid",
    "dispatch_threads_per_threadgroup",
})
INDEX_ATTRIBUTES = frozenset({
    "thread_index_in_threadgroup", "thread_index_in_simdgroup", "thread_index_in_quadgroup",
    "simdgroup_index_in_threadgroup", "quadgroup_index_in_threadgroup", "simdgroups_per_threadgroup",
    "quadgroups_per_threadgroup", "threads_per_simdgroup", "thread_execution_width",
    "dispatch_simdgroups_per_threadgroup", "dispatch_quadgroups_per_threadgroup",
})
# The thread attributes whose value differs between the threads of a
# threadgroup (the others are the same for all: sizes, counts, the group's
# own position).
VARYING_ATTRIBUTES = frozenset({
    "thread_position_in_grid", "thread_position_in_threadgroup", "thread_index_in_threadgroup",
    "thread_index_in_simdgroup", "thread_index_in_quadgroup", "simdgroup_index_in_threadgroup",
    "quadgroup_index_in_threadgroup",
})
# Attributes of a kernel function itself (host_name goes on the explicit
# instantiations, which the check does not parse).
KERNEL_ATTRIBUTES = frozenset({"kernel", "max_total_threads_per_threadgroup"})
# Every attribute name the sources may use (sections 5.1-5.2).
MSL_ATTRIBUTES = (frozenset(RESOURCE_INDICES) | POSITION_ATTRIBUTES | INDEX_ATTRIBUTES | KERNEL_ATTRIBUTES
                  | {"host_name", "function_constant"})
THREAD_INTEGERS = (ci.TypeKind.UINT, ci.TypeKind.USHORT)

ANNOTATION = re.compile(r"msl:(\w+)(?:\((.*)\))?", re.S)


@dataclass(frozen=True)
class Attribute:
    name: str
    args: str | None


def attributes(cursor: ci.Cursor) -> list[Attribute]:
    """The MSL attributes written on `cursor`'s declaration."""
    found = []
    for c in cursor.get_children():
        if c.kind == ci.CursorKind.ANNOTATE_ATTR:
            m = ANNOTATION.fullmatch(c.spelling)
            if m:
                found.append(Attribute(m.group(1), m.group(2)))
    return found


def is_kernel(cursor: ci.Cursor) -> bool:
    return (cursor.kind in (ci.CursorKind.FUNCTION_TEMPLATE, ci.CursorKind.FUNCTION_DECL)
            and cursor.is_definition() and any(a.name == "kernel" for a in attributes(cursor)))


def parameters(kernel: ci.Cursor) -> list[ci.Cursor]:
    return [p for p in kernel.get_children() if p.kind == ci.CursorKind.PARM_DECL]


def thread_attribute(parameter: ci.Cursor) -> str | None:
    """The thread attribute of a kernel parameter, if it has one."""
    for a in attributes(parameter):
        if a.name in POSITION_ATTRIBUTES or a.name in INDEX_ATTRIBUTES:
            return a.name
    return None


def components(t: ci.Type) -> int | None:
    """1 for a ushort or uint, n for an n-vector of them, else None."""
    t = t.get_canonical()
    if t.kind in THREAD_INTEGERS:
        return 1
    if t.kind in (ci.TypeKind.EXTVECTOR, ci.TypeKind.VECTOR) and t.element_type.get_canonical().kind in THREAD_INTEGERS:
        return t.element_count
    return None


def check_kernel(kernel: ci.Cursor, space_of: Callable[[ci.Type], str | None],
                 add: Callable[[ci.SourceLocation, str], None]) -> None:
    """The attributes of `kernel` and of its parameters. space_of names the
    address space of a pointer's or reference's pointee (None for thread
    memory or no pointer)."""
    for a in attributes(kernel):
        if a.name not in KERNEL_ATTRIBUTES:
            add(kernel.location, f"[[{a.name}]] is not an attribute of a kernel function")
    used: dict[tuple[str, int], str] = {}
    widths: dict[int, str] = {}
    for p in parameters(kernel):
        attrs = attributes(p)
        if len(attrs) != 1:
            add(p.location, f"kernel parameter '{p.spelling}' needs exactly one MSL attribute "
                            f"(a resource index or a thread attribute), not {len(attrs)}")
            continue
        a = attrs[0]
        if a.name in RESOURCE_INDICES:
            index = a.args.strip() if a.args else ""
            if not re.fullmatch(r"\d+[uU]?", index):
                add(p.location, f"[[{a.name}({index})]] of '{p.spelling}': the index must be an integer literal")
                continue
            i = int(index.rstrip("uU"))
            if i >= RESOURCE_INDICES[a.name]:
                add(p.location, f"[[{a.name}({i})]] of '{p.spelling}': {a.name} indices are "
                                f"0-{RESOURCE_INDICES[a.name] - 1}")
            if (a.name, i) in used:
                add(p.location, f"[[{a.name}({i})]] of '{p.spelling}' is also '{used[a.name, i]}''s: "
                                f"one {a.name} index per parameter of a kernel")
            used.setdefault((a.name, i), p.spelling)
            spaces = RESOURCE_SPACES.get(a.name)
            if spaces is not None and space_of(p.type) not in spaces:
                add(p.location, f"[[{a.name}({i})]] takes a pointer or reference to "
                                f"{' or '.join(spaces)} memory, not '{p.type.spelling}' ('{p.spelling}')")
        elif a.name in POSITION_ATTRIBUTES or a.name in INDEX_ATTRIBUTES:
            n = components(p.type)
            allowed = "ushort or uint, or a 2- or 3-vector of them" if a.name in POSITION_ATTRIBUTES \
                else "ushort or uint"
            if n is None or (a.name in INDEX_ATTRIBUTES and n != 1) or n > 3:
                add(p.location, f"[[{a.name}]] takes {allowed}, not '{p.type.spelling}' ('{p.spelling}')")
            elif a.name in POSITION_ATTRIBUTES:
                widths.setdefault(n, p.spelling)
        else:
            add(p.location, f"[[{a.name}]] is not an attribute of a kernel parameter ('{p.spelling}')")
    if len(widths) > 1:
        add(kernel.location, f"kernel '{kernel.spelling}' mixes positions of {sorted(widths)} components "
                             f"({', '.join(widths[n] for n in sorted(widths))}): one width for all")


def check_helper(function: ci.Cursor, add: Callable[[ci.SourceLocation, str], None]) -> None:
    """A function that is not a kernel takes no kernel attributes."""
    for p in parameters(function):
        for a in attributes(p):
            add(p.location, f"[[{a.name}]] on '{p.spelling}' of '{function.spelling}', which is not a kernel")
