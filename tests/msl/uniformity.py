"""No threadgroup barrier in control flow that depends on the thread.

A threadgroup_barrier must be reached by every thread of the threadgroup or
by none (MSL specification section 6.9.1); one inside a branch some threads
skip hangs or corrupts the group, and the emulator sees that only on the
paths its tests take. This is a static, conservative proof over each
function that reaches a barrier (directly or through the calls it makes),
from the template patterns as written:

- a value is *varying* if it may differ between the threads of a
  threadgroup: a varying thread attribute (thread_position_in_threadgroup,
  thread_index_in_simdgroup, ...), a read of threadgroup memory, a SIMD-group
  function or an atomic, a call to a function that does either, anything
  computed from a varying value, and a variable assigned under varying
  control flow; a helper's parameter is varying if it is at any call;
- constants, template parameters, uniform thread attributes (the group's
  position, sizes and counts), and reads of device or constant memory at a
  uniform address are uniform. A race on device memory is the emulator's
  and ThreadSanitizer's to find, not this proof's;
- control flow is varying under an if, a loop, a switch, a ?: or a && / ||
  whose condition is varying, after a return taken under varying control
  flow (to the function's end), and in a loop that a break, continue or
  return under varying control flow leaves.

A barrier, or a call to a function that reaches one, under varying control
flow is a finding. What the proof cannot see but the code guarantees (a
value every thread reads from threadgroup memory after a barrier, a sum
over the threadgroup) is marked in the source by a comment holding
``msl-uniform:`` and the reason, on the line of the declaration, assignment
or statement it vouches for, or on the comment lines just above it. A mark on a variable or parameter
makes it uniform (for a threadgroup pointer: what it points to, read at a
uniform index), on a field every access to it, on a function the value of
every call to it, on an if or a loop its condition, on an assignment the
value assigned.
"""

from __future__ import annotations

import re
from typing import Callable

import clang.cindex as ci

import interface

MARK = "msl-uniform:"
BARRIERS = frozenset({"threadgroup_barrier"})
# Each thread's own result: SIMD-group and quad-group functions (the same at
# most within one SIMD group) and atomics.
VARYING_CALL = re.compile(r"(simd|quad)_\w+|atomic_\w+")
FUNCTION_KINDS = frozenset({
    ci.CursorKind.FUNCTION_DECL, ci.CursorKind.FUNCTION_TEMPLATE, ci.CursorKind.CXX_METHOD,
    ci.CursorKind.CONSTRUCTOR, ci.CursorKind.DESTRUCTOR, ci.CursorKind.CONVERSION_FUNCTION,
})
LOOPS = frozenset({ci.CursorKind.FOR_STMT, ci.CursorKind.WHILE_STMT, ci.CursorKind.DO_STMT})
VARIABLES = frozenset({ci.CursorKind.VAR_DECL, ci.CursorKind.PARM_DECL})
# How each mode spells the threadgroup address space in a type.
THREADGROUP_SPELLED = re.compile(r"address_space\(3\)|__local\b")

Key = tuple


def key(c: ci.Cursor) -> Key:
    loc = c.location
    return (loc.file.name if loc.file else "", loc.line, loc.column)


def node(f: ci.Cursor) -> str:
    """One name for a function and all its instantiations."""
    template = ci.conf.lib.clang_getSpecializedCursorTemplate(f)
    if template is not None and not template.kind.is_invalid():
        f = template
    return f.canonical.get_usr() or f.displayname


def where(c: ci.Cursor) -> str:
    loc = c.location
    return f"{loc.file.name.rsplit('/', 1)[-1] if loc.file else '?'}:{loc.line}"


def marked_lines(files: dict[str, str]) -> set[tuple[str, int]]:
    """(file, line) of each statement a ``msl-uniform:`` comment vouches for."""
    marked = set()
    for path, text in files.items():
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if MARK not in line:
                continue
            j = i
            if line.strip().startswith("//"):
                while j < len(lines) and lines[j].strip().startswith("//"):
                    j += 1
            marked.add((path, j + 1))
    return marked


class Analysis:
    def __init__(self, cursors: list[ci.Cursor], ours: Callable[[ci.Cursor], bool], files: dict[str, str],
                 add: Callable[[ci.SourceLocation, str], None]):
        self.ours = ours
        self.add = add
        self.children: dict[ci.Cursor, list[ci.Cursor]] = {}
        self.marked = marked_lines(files)
        self.operators: dict[Key, str] = {}
        self.functions: dict[str, ci.Cursor] = {}
        for f in cursors:
            if f.kind in FUNCTION_KINDS and f.is_definition():
                self.functions.setdefault(node(f), f)
        self.marked_fields = {c.spelling for c in cursors if c.kind == ci.CursorKind.FIELD_DECL and self.is_marked(c)}
        self.by_name: dict[str, list[str]] = {}
        for n, f in self.functions.items():
            self.by_name.setdefault(f.spelling, []).append(n)
        self.inside = {n: list(f.walk_preorder()) for n, f in self.functions.items()}
        self.calls = {n: self.callees(n) for n in self.functions}
        self.reaches_barrier = self.closure(lambda n: any(
            c.kind == ci.CursorKind.CALL_EXPR and c.spelling in BARRIERS for c in self.inside[n]))
        self.varying_result = self.closure(self.reads_varying)
        self.varying_params: dict[str, set[int]] = {n: set() for n in self.functions}
        self.varying_this: dict[str, bool] = {n: False for n in self.functions}
        # Whether a function's value varies, for those run() analyses.
        self.returns_varying: dict[str, bool] = {}
        self.analysed: dict[str, tuple] = {}
        self.version = 0  # bumped when a parameter or a value summary changes
        self.params_changed = False
        # The state of the function being analysed.
        self.env: dict = {}
        self.loop_exits: dict[Key, str] = {}
        self.loops: list[Key] = []
        self.exit: str | None = None
        self.returned_varying = False
        self.changed = False
        self.report = False

    def kids(self, c: ci.Cursor) -> list[ci.Cursor]:
        """c's children (libclang's walk is the analysis's cost)."""
        found = self.children.get(c)
        if found is None:
            found = self.children[c] = list(c.get_children())
        return found

    # -- the call graph

    def targets(self, call: ci.Cursor) -> list[str]:
        """Our functions that `call` may call: resolved, else by name (a
        call through a template parameter: every function of that name, or
        every operator() for a functor)."""
        lib = ci.conf.lib
        kids = self.kids(call)
        callee = kids[0] if kids else None
        candidates = [call]
        if callee is not None:
            candidates.append(callee)
            if callee.kind in (ci.CursorKind.DECL_REF_EXPR, ci.CursorKind.UNEXPOSED_EXPR):
                candidates += self.kids(callee)
        found, names = [], set()
        for c in candidates:
            r = c.referenced if c.kind != ci.CursorKind.OVERLOADED_DECL_REF else c
            if r is None:
                continue
            if r.kind == ci.CursorKind.OVERLOADED_DECL_REF:
                found += [lib.clang_getOverloadedDecl(r, i) for i in range(lib.clang_getNumOverloadedDecls(r))]
                names.add(r.spelling)
            elif c.kind in (ci.CursorKind.CALL_EXPR, ci.CursorKind.DECL_REF_EXPR, ci.CursorKind.MEMBER_REF_EXPR) \
                    and r.kind in FUNCTION_KINDS:
                found.append(r)
            if found:
                break
        resolved = [node(f) for f in found if self.ours(f)]
        if found:
            return [n for n in resolved if n in self.functions]
        for name in [call.spelling, *names]:
            if name in self.by_name:
                return self.by_name[name]
        while callee is not None and callee.kind == ci.CursorKind.UNEXPOSED_EXPR:
            callee = next(iter(self.kids(callee)), None)
        if callee is not None and callee.referenced is not None and callee.referenced.kind in (
                ci.CursorKind.VAR_DECL, ci.CursorKind.PARM_DECL, ci.CursorKind.FIELD_DECL):
            return self.by_name.get("operator()", [])  # a functor
        return []

    def callees(self, n: str) -> set[str]:
        return {t for c in self.inside[n] if c.kind == ci.CursorKind.CALL_EXPR for t in self.targets(c)}

    def closure(self, direct: Callable[[str], bool]) -> set[str]:
        """The functions for which `direct` holds, or that call one."""
        result = {n for n in self.functions if direct(n)}
        changed = True
        while changed:
            changed = False
            for n, callees in self.calls.items():
                if n not in result and callees & result:
                    result.add(n)
                    changed = True
        return result

    def reads_varying(self, n: str) -> bool:
        for c in self.inside[n]:
            if c.kind == ci.CursorKind.CALL_EXPR and VARYING_CALL.fullmatch(c.spelling):
                return True
            if c.kind in (ci.CursorKind.ARRAY_SUBSCRIPT_EXPR, ci.CursorKind.MEMBER_REF_EXPR,
                          ci.CursorKind.UNARY_OPERATOR) and self.reads_threadgroup(c):
                return True
        return False

    # -- values

    def operator(self, e: ci.Cursor) -> str:
        """The operator token of a unary or binary operator expression."""
        k = key(e) + (e.extent.start.offset, e.extent.end.offset)
        if k not in self.operators:
            tokens = [t.spelling for t in e.get_tokens()]
            children = self.kids(e)
            op = ""
            if e.kind == ci.CursorKind.UNARY_OPERATOR:
                op = tokens[0] if tokens and tokens[0] in ("*", "&", "++", "--", "-", "!", "~", "+") else (
                    tokens[-1] if tokens else "")
            elif children:
                end = children[0].extent.end.offset
                op = next((t.spelling for t in e.get_tokens() if t.extent.start.offset >= end), "")
            self.operators[k] = op
        return self.operators[k]

    def member_name(self, e: ci.Cursor) -> str:
        """A member expression's name (libclang spells none through a
        dependent type): its last token."""
        if e.spelling:
            return e.spelling
        k = key(e) + (e.extent.end.offset,)
        if k not in self.operators:
            tokens = list(e.get_tokens())
            self.operators[k] = tokens[-1].spelling if tokens else ""
        return self.operators[k]

    @staticmethod
    def in_threadgroup(t: ci.Type) -> bool:
        if t.kind in (ci.TypeKind.POINTER, ci.TypeKind.LVALUEREFERENCE):
            t = t.get_pointee()
        return bool(THREADGROUP_SPELLED.search(t.spelling))

    def reads_threadgroup(self, e: ci.Cursor) -> bool:
        """`e` reads threadgroup memory: a subscript or dereference of a
        threadgroup pointer, a member of a threadgroup object."""
        children = self.kids(e)
        if not children:
            return False
        if e.kind == ci.CursorKind.UNARY_OPERATOR and self.operator(e) != "*":
            return False
        return self.in_threadgroup(children[0].type)

    def is_local(self, r: ci.Cursor) -> bool:
        parent = r.semantic_parent
        return r.kind == ci.CursorKind.PARM_DECL or (parent is not None and parent.kind in FUNCTION_KINDS)

    def root_variable(self, e: ci.Cursor) -> ci.Cursor | None:
        """The variable a pointer expression names, through casts."""
        while e.kind != ci.CursorKind.DECL_REF_EXPR:
            children = self.kids(e)
            if e.kind not in (ci.CursorKind.UNEXPOSED_EXPR, ci.CursorKind.PAREN_EXPR) or len(children) != 1:
                return None
            e = children[0]
        return e.referenced

    def varying(self, e: ci.Cursor) -> bool:
        k = e.kind
        children = self.kids(e)
        if k == ci.CursorKind.DECL_REF_EXPR:
            r = e.referenced
            if r is not None and r.kind in VARIABLES and self.is_local(r):
                return not self.is_marked(r) and self.env.get(key(r), False)
            return False  # program-scope constants, enumerators, template parameters, functions
        if k == ci.CursorKind.CXX_THIS_EXPR:
            return self.env.get("this", False)
        if k == ci.CursorKind.MEMBER_REF_EXPR:
            r = e.referenced
            if r is not None and r.kind == ci.CursorKind.FIELD_DECL and self.is_marked(r):
                return False
            if r is None and self.member_name(e) in self.marked_fields:
                return False  # through a dependent type: a marked field of that name
            if not children:
                return self.env.get("this", False) or self.reads_threadgroup(e)
        if k in (ci.CursorKind.ARRAY_SUBSCRIPT_EXPR, ci.CursorKind.MEMBER_REF_EXPR, ci.CursorKind.UNARY_OPERATOR) \
                and self.reads_threadgroup(e):
            pointer = self.root_variable(children[0])
            if pointer is None or not self.is_marked(pointer):
                return True
            return any(self.varying(c) for c in children[1:])
        if k == ci.CursorKind.CALL_EXPR:
            if VARYING_CALL.fullmatch(e.spelling):
                return True
            targets = self.targets(e)
            if targets and all(self.is_marked(self.functions[t]) for t in targets):
                return False
            if targets and all(t in self.returns_varying for t in targets):
                # Analysed with its parameters as varying as at any call.
                return any(self.returns_varying[t] for t in targets)
            if any(t in self.varying_result for t in targets):
                return True
        return any(self.varying(c) for c in children)

    # -- statements

    def assign(self, target: ci.Cursor, value: bool) -> None:
        """`target` (an lvalue) becomes varying if `value` is."""
        while True:
            children = self.kids(target)
            if target.kind == ci.CursorKind.DECL_REF_EXPR:
                r = target.referenced
                if r is not None and r.kind in VARIABLES and self.is_local(r) and value:
                    self.set_varying(key(r))
                return
            if target.kind == ci.CursorKind.ARRAY_SUBSCRIPT_EXPR and len(children) == 2:
                if children[0].type.kind == ci.TypeKind.POINTER:
                    return  # a write to memory, not to a variable
                value = value or self.varying(children[1])
            elif target.kind == ci.CursorKind.MEMBER_REF_EXPR and (
                    not children or children[0].type.kind == ci.TypeKind.POINTER):
                return
            elif target.kind == ci.CursorKind.UNARY_OPERATOR:
                return  # *p
            if not children:
                return
            target = children[0]

    def set_varying(self, k) -> None:
        if not self.env.get(k, False):
            self.env[k] = True
            self.changed = True

    def is_marked(self, c: ci.Cursor) -> bool:
        """A mark vouches for `c`: on its line, or for a function on any
        line from its start (a template's) to its name."""
        loc = c.location
        if loc.file is None:
            return False
        first = c.extent.start.line if c.kind in FUNCTION_KINDS else loc.line
        return any((loc.file.name, line) in self.marked for line in range(first, loc.line + 1))

    def expr(self, e: ci.Cursor, flow: str | None) -> None:
        """The calls and assignments of `e`, under `flow` (the reason control
        flow is varying there, or None)."""
        k = e.kind
        children = self.kids(e)
        if k == ci.CursorKind.CALL_EXPR:
            if e.spelling in BARRIERS:
                if flow and self.report:
                    self.add(e.location, f"threadgroup_barrier under varying control flow ({flow}); "
                                         f"prove it uniform or mark it '{MARK} <reason>'")
            else:
                targets = self.targets(e)
                reached = [t for t in targets if t in self.reaches_barrier]
                if reached and flow and self.report:
                    self.add(e.location, f"call to '{self.functions[reached[0]].spelling}', which reaches a "
                                         f"threadgroup_barrier, under "
                                         f"varying control flow ({flow})")
                arguments = list(e.get_arguments())
                if not arguments and len(children) > 1:
                    arguments = children[1:]  # a dependent call: its children after the callee
                member = children[0] if children and children[0].kind == ci.CursorKind.MEMBER_REF_EXPR else None
                this_varying = member is not None and any(self.varying(c) for c in self.kids(member))
                for t in targets:
                    for i, a in enumerate(arguments):
                        if i not in self.varying_params[t] and self.varying(a):
                            self.varying_params[t].add(i)
                            self.params_changed = True
                    if this_varying and not self.varying_this[t]:
                        self.varying_this[t] = True
                        self.params_changed = True
        elif k in (ci.CursorKind.BINARY_OPERATOR, ci.CursorKind.COMPOUND_ASSIGNMENT_OPERATOR) and len(children) == 2:
            lhs, rhs = children
            op = self.operator(e)
            if op in ("&&", "||"):
                self.expr(lhs, flow)
                self.expr(rhs, flow or self.reason(lhs, e, "the operand before"))
                return
            if op.endswith("=") and op not in ("==", "!=", "<=", ">="):
                value = not self.is_marked(e) and (
                    bool(flow) or self.varying(rhs) or (op != "=" and self.varying(lhs)))
                self.assign(lhs, value)
        elif k == ci.CursorKind.UNARY_OPERATOR and children and self.operator(e) in ("++", "--"):
            self.assign(children[0], not self.is_marked(e) and (bool(flow) or self.varying(children[0])))
        elif k == ci.CursorKind.CONDITIONAL_OPERATOR and len(children) == 3:
            self.expr(children[0], flow)
            branch = flow or self.reason(children[0], e, "the condition of ?:")
            self.expr(children[1], branch)
            self.expr(children[2], branch)
            return
        for c in children:
            self.expr(c, flow)

    def reason(self, condition: ci.Cursor, statement: ci.Cursor, what: str) -> str | None:
        if self.is_marked(statement) or not self.varying(condition):
            return None
        return f"{what} at {where(statement)} varies between threads"

    def stmt(self, s: ci.Cursor, flow: str | None) -> None:
        k = s.kind
        flow = flow or self.exit
        children = self.kids(s)
        if k == ci.CursorKind.COMPOUND_STMT:
            for c in children:
                self.stmt(c, flow)
        elif k == ci.CursorKind.DECL_STMT:
            for v in children:
                if v.kind != ci.CursorKind.VAR_DECL:
                    continue
                inits = [c for c in self.kids(v) if c.kind.is_expression()]
                for init in inits:
                    self.expr(init, flow)
                if inits and not self.is_marked(v) and self.varying(inits[-1]):
                    self.set_varying(key(v))
        elif k == ci.CursorKind.IF_STMT and len(children) >= 2:
            self.expr(children[0], flow)
            branch = flow or self.reason(children[0], s, "the condition")
            for c in children[1:]:
                self.stmt(c, branch)
        elif k == ci.CursorKind.SWITCH_STMT and len(children) == 2:
            self.expr(children[0], flow)
            self.stmt(children[1], flow or self.reason(children[0], s, "the switch"))
        elif k in LOOPS:
            self.loop(s, children, flow)
        elif k == ci.CursorKind.RETURN_STMT:
            for c in children:
                self.expr(c, flow)
            if flow or any(self.varying(c) for c in children):
                self.returned_varying = True
            if flow:
                self.exit = self.exit or f"a return at {where(s)} taken by some threads only, under {flow}"
                for loop in self.loops:
                    self.leave(loop, f"a return at {where(s)} under {flow}")
        elif k in (ci.CursorKind.BREAK_STMT, ci.CursorKind.CONTINUE_STMT):
            if flow and self.loops:
                self.leave(self.loops[-1], f"a {'break' if k == ci.CursorKind.BREAK_STMT else 'continue'} "
                                           f"at {where(s)} under {flow}")
        elif k.is_expression():
            self.expr(s, flow)
        else:
            for c in children:
                if c.kind.is_statement() or c.kind.is_declaration():
                    self.stmt(c, flow)
                elif c.kind.is_expression():
                    self.expr(c, flow)

    def leave(self, loop: Key, why: str) -> None:
        if loop not in self.loop_exits:
            self.loop_exits[loop] = why
            self.changed = True

    def loop(self, s: ci.Cursor, children: list[ci.Cursor], flow: str | None) -> None:
        if s.kind == ci.CursorKind.DO_STMT:
            body, header = children[0], children[1:]
        else:
            header, body = children[:-1], children[-1]
        for h in header:
            if h.kind == ci.CursorKind.DECL_STMT:
                self.stmt(h, flow)
        this = key(s)
        reason = flow or self.loop_exits.get(this)
        if reason is None and not self.is_marked(s):
            condition = self.loop_condition(s, header)
            if condition is not None and self.varying(condition):
                reason = f"the loop at {where(s)} runs a varying number of times"
        self.loops.append(this)
        self.stmt(body, reason)
        for h in header:
            if h.kind != ci.CursorKind.DECL_STMT:
                self.expr(h, reason)
        self.loops.pop()

    @staticmethod
    def loop_condition(s: ci.Cursor, header: list[ci.Cursor]) -> ci.Cursor | None:
        """The condition among a loop's header parts (a for's init and
        increment are not: what they assign is tracked instead)."""
        if s.kind != ci.CursorKind.FOR_STMT:
            return header[0] if header else None
        depth, semicolons = 0, []
        for token in s.get_tokens():
            depth += token.spelling == "("
            depth -= token.spelling == ")"
            if token.spelling == ";" and depth == 1:
                semicolons.append(token.extent.start.offset)
            if depth == 0 and semicolons:
                break
        if len(semicolons) < 2:
            return None
        return next((h for h in header if semicolons[0] < h.extent.start.offset < semicolons[1]), None)

    # -- functions

    def analyse(self, n: str, report: bool) -> None:
        state = (frozenset(self.varying_params[n]), self.varying_this[n], self.version)
        if not report and self.analysed.get(n) == state:
            return
        self.analysed[n] = state
        f = self.functions[n]
        kernel = interface.is_kernel(f)
        params = [c for c in f.get_children() if c.kind == ci.CursorKind.PARM_DECL]
        self.loop_exits = {}
        self.env = {}
        for i, p in enumerate(params):
            if kernel:
                self.env[key(p)] = interface.thread_attribute(p) in interface.VARYING_ATTRIBUTES
            else:
                self.env[key(p)] = i in self.varying_params[n]
        self.env["this"] = self.varying_this[n]
        body = next((c for c in f.get_children() if c.kind == ci.CursorKind.COMPOUND_STMT), None)
        if body is None:
            return
        self.returned_varying = False
        for _ in range(8):
            self.changed = False
            self.report = False
            self.exit = None
            self.loops = []
            self.stmt(body, None)
            if not self.changed:
                break
        if self.returned_varying and not self.returns_varying.get(n):
            self.returns_varying[n] = True
            self.params_changed = True
        if report:
            self.report = True
            self.exit = None
            self.loops = []
            self.stmt(body, None)
            self.report = False

    def run(self) -> None:
        relevant = [n for n in self.functions if n in self.reaches_barrier]
        # From each one's own analysis (the others: varying_result), uniform
        # until shown otherwise.
        self.returns_varying = {n: False for n in relevant}
        for _ in range(12):
            self.params_changed = False
            for n in relevant:
                self.analyse(n, report=False)
            if not self.params_changed:
                break
            self.version += 1
        for n in relevant:
            self.analyse(n, report=True)


def check_barriers(cursors: list[ci.Cursor], ours: Callable[[ci.Cursor], bool], files: dict[str, str],
                   add: Callable[[ci.SourceLocation, str], None]) -> None:
    Analysis(cursors, ours, files, add).run()
