"""Reading the files users name: every workload, profile, trace, config.json and calibration goes
through here, so each gets the same refusals before memory or time is spent on it.

- only regular files (symlinks followed): a directory, FIFO (which would block), device
  (/dev/zero never ends) or socket is refused after opening without blocking;
- sizes are checked with fstat on the opened file, and reads are capped, so a file swapped or
  growing between the check and the read cannot get past the limit;
- UTF-8 text only (a byte-order mark is dropped);
- YAML is composed under a budget of nesting depth and of nodes *after* alias expansion, so an
  alias bomb is refused while its few hundred bytes are read, never expanded;
- JSON deeper than MAX_NESTING_DEPTH is refused, never a RecursionError.

Errors are InputErrors naming the file and the limit; none quotes the file's contents beyond a
short excerpt of a parser's complaint. The limits live in engine/limits.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
import json
import os
from pathlib import Path
import stat
from typing import BinaryIO, Protocol, TypeVar

import yaml

from engine import limits
from engine.errors import EXCERPT_CHARS, InputError, over_limit


@contextmanager
def _open_regular(path: Path, field: str, max_bytes_limit: str) -> Iterator[BinaryIO]:
    """`path` opened for reading, if it is a regular file within the size limit named."""
    # O_NONBLOCK: opening a FIFO with no writer would otherwise hang; regular files ignore it.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InputError(field, str(path), "no such file") from None
    except OSError as exc:
        raise InputError(field, str(path), f"cannot open ({exc.strerror or type(exc).__name__})") from None
    try:
        mode = os.fstat(fd)
        if stat.S_ISDIR(mode.st_mode):
            raise InputError(field, str(path), "is a directory, not a file")
        if not stat.S_ISREG(mode.st_mode):
            raise InputError(field, str(path), "is not a regular file (a FIFO, device or socket)")
        if mode.st_size > getattr(limits, max_bytes_limit):
            raise over_limit(field, str(path), max_bytes_limit, f"its size ({mode.st_size:,} bytes)")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_bytes(path: str | Path, field: str, max_bytes_limit: str) -> bytes:
    """The whole of a regular file no larger than engine.limits.`max_bytes_limit`."""
    path = Path(path)
    with _open_regular(path, field, max_bytes_limit) as f:
        try:
            data = f.read(getattr(limits, max_bytes_limit) + 1)
        except OSError as exc:
            raise InputError(field, str(path), f"cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > getattr(limits, max_bytes_limit):
        raise over_limit(field, str(path), max_bytes_limit, "the file grew while read and")
    return data


def read_text(path: str | Path, field: str, max_bytes_limit: str) -> str:
    """A UTF-8 text file (byte-order mark dropped) no larger than engine.limits.`max_bytes_limit`."""
    data = read_bytes(path, field, max_bytes_limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(field, str(path), f"is not UTF-8 text (byte {exc.start:,} is not)") from None


def iter_lines(path: str | Path, field: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a trace, streamed: at most MAX_TRACE_BYTES in all and
    MAX_LINE_BYTES a line, so memory stays flat however long the file."""
    path = Path(path)
    with _open_regular(path, field, "MAX_TRACE_BYTES") as f:
        total = 0
        line_no = 0
        while raw := f.readline(limits.MAX_LINE_BYTES + 1):
            line_no += 1
            total += len(raw)
            if len(raw) > limits.MAX_LINE_BYTES:
                raise over_limit(field, str(path), "MAX_LINE_BYTES", f"the length of line {line_no:,}")
            if total > limits.MAX_TRACE_BYTES:
                raise over_limit(field, str(path), "MAX_TRACE_BYTES", "the file grew while read and")
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError:
                raise InputError(field, str(path), f"is not UTF-8 text (line {line_no} is not)") from None
            yield line_no, text


# --------------------------------------------------------------------------- YAML


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts, while composing, the nodes the document would have with every alias
    expanded, and refuses past MAX_YAML_NODES or deeper than MAX_NESTING_DEPTH. Composition only
    links an alias to its anchor's node, so the count costs one step per alias, whatever it expands to."""

    def __init__(self, text: str, path: Path, field: str) -> None:
        super().__init__(text)
        self._path, self._field = path, field
        self._depth = 0
        self._nodes = 0  # expanded nodes composed so far
        self._expanded: dict[int, int] = {}  # id(finished node) -> its expanded size

    def _count(self, n: int) -> None:
        self._nodes += n
        if self._nodes > limits.MAX_YAML_NODES:
            raise over_limit(self._field, str(self._path), "MAX_YAML_NODES", "its node count with aliases expanded")

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            node = self.anchors.get(self.peek_event().anchor)
            if node is not None:  # an unknown anchor is the composer's own error
                size = self._expanded.get(id(node))
                if size is None:
                    raise InputError(self._field, str(self._path), "an alias refers to a node that contains it")
                self._count(size)
            return super().compose_node(parent, index)
        if self._depth >= limits.MAX_NESTING_DEPTH:
            raise over_limit(self._field, str(self._path), "MAX_NESTING_DEPTH", "its nesting depth")
        self._depth += 1
        start = self._nodes
        node = super().compose_node(parent, index)
        self._depth -= 1
        # A long scalar counts as several nodes, so that aliasing one cannot multiply megabytes.
        self._count(1 + len(node.value) // 256 if isinstance(node, yaml.ScalarNode) else 1)
        self._expanded[id(node)] = self._nodes - start
        return node


def parse_yaml(text: str, path: Path, field: str) -> object:
    try:
        loader = _BoundedLoader(text, path, field)  # the reader refuses control characters here
    except yaml.reader.ReaderError as exc:
        raise InputError(field, str(path), f"malformed YAML (character #x{exc.character:04x} at position "
                                           f"{exc.position:,} is not allowed)") from None
    try:
        return loader.get_single_data()
    except InputError:  # the loader's own refusals (it is a ValueError, caught below otherwise)
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        # str(exc) would quote the offending line of the file: name only the problem and where.
        problem = (exc.problem or exc.context or "")[:EXCERPT_CHARS]
        raise InputError(field, str(path), f"malformed YAML: {problem}{at}") from None
    except yaml.YAMLError as exc:
        raise InputError(field, str(path), f"malformed YAML ({type(exc).__name__})") from None
    except (ValueError, OverflowError):  # a scalar the constructor cannot convert, e.g. a 5,000-digit int
        raise InputError(field, str(path), "malformed YAML (a value it cannot convert)") from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path, field: str) -> object:
    """A YAML file (JSON is YAML too) within MAX_YAML_BYTES, MAX_NESTING_DEPTH and MAX_YAML_NODES."""
    path = Path(path)
    return parse_yaml(read_text(path, field, "MAX_YAML_BYTES"), path, field)


# --------------------------------------------------------------------------- JSON


def _depth(data: object) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((v, depth) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def parse_json(text: str, field: str, value: object) -> object:
    """JSON `text`; errors are `field=value is invalid: ...` (value: the file's path, or the
    JSONL line, which the message cuts to an excerpt)."""
    try:
        data = json.loads(text)
    except RecursionError:  # the C decoder's own guard against deep nesting
        raise over_limit(field, value, "MAX_NESTING_DEPTH", "its nesting depth") from None
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno}, column {exc.colno}" if "\n" in text.strip() else f"column {exc.colno}"
        raise InputError(field, value, f"not valid JSON ({exc.msg} at {at})") from None
    except ValueError:  # an integer of more digits than int() accepts (sys.get_int_max_str_digits)
        raise InputError(field, value, "not valid JSON (a number too long to convert)") from None
    if _depth(data) > limits.MAX_NESTING_DEPTH:
        raise over_limit(field, value, "MAX_NESTING_DEPTH", "its nesting depth")
    return data


def load_json(path: str | Path, field: str, max_bytes_limit: str = "MAX_JSON_BYTES") -> object:
    """A JSON file within engine.limits.`max_bytes_limit` and MAX_NESTING_DEPTH."""
    path = Path(path)
    return parse_json(read_text(path, field, max_bytes_limit), field, str(path))


class _Named(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the profiles are frozen models


Profile = TypeVar("Profile", bound=_Named)


def profile_folder(folder: Path, load: Callable[[Path], Profile]) -> dict[str, Profile]:
    """Every `*.yaml` profile of a catalog folder by name; a profile is named after its file, so a
    name on the command line finds one file and two files cannot claim one name."""
    profiles: dict[str, Profile] = {}
    for path in sorted(folder.glob("*.yaml")):
        profile = load(path)
        if profile.name != path.stem:
            raise InputError(f"{path.name}: name", profile.name, f"must equal the file name {path.stem!r}")
        profiles[profile.name] = profile
    return profiles


# --------------------------------------------------------------------------- outputs


def output_file(path: str | Path, field: str) -> Path:
    """`path` as a file that will be written once the work is done, checked before the work starts,
    so that a typo in an output path does not throw away minutes of measuring: not a folder or a
    device, in an existing folder this process may write into. An existing file is replaced."""
    path = Path(path)
    if path.is_dir():
        raise InputError(field, str(path), "is a folder; give the name of a file to write")
    if path.exists() and not path.is_file():
        raise InputError(field, str(path), "exists and is not a regular file (a FIFO, device or socket)")
    folder = path.parent
    if not folder.is_dir():
        raise InputError(field, str(path), f"its folder {str(folder)[:EXCERPT_CHARS]!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(field, str(path), f"its folder {str(folder)[:EXCERPT_CHARS]!r} is not writable")
    return path
