"""Reading the small text files a run is given (yaml configs, label files, image lists) as if they
were hostile: regular files only (a FIFO would block, /dev/zero never ends), at most a size limit,
UTF-8, and YAML without aliases (a 1 KB alias bomb expands to gigabytes when walked). Every
refusal is one FileError line naming the file."""

import os
import re
import stat

import yaml

MAX_YAML_BYTES = 1_000_000  # a data yaml, --hyp or model cfg (yolov5's largest: 3 KB)
KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
# O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer (Windows has no such
# flag); os.open's descriptors are not inherited by child processes already (PEP 446)
READ_NONBLOCKING = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)


class FileError(ValueError):
    """A file that cannot be read as the text it should be: one line naming the file."""


def read_bytes(path, limit, what=""):
    """The bytes of a regular file of at most limit bytes; else FileError naming `what path`."""
    name = f"{what} {path}".strip()
    try:
        fd = os.open(path, READ_NONBLOCKING)
    except OSError as e:
        raise FileError(f"{name}: cannot open it ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = KINDS.get(stat.S_IFMT(mode), "not a file")
        raise FileError(f"{name}: {kind}, not a regular file")
    try:
        with os.fdopen(fd, "rb") as f:
            # one byte more than the limit: a file that grows while it is read is still caught
            data = f.read(limit + 1)
    except OSError as e:
        raise FileError(f"{name}: cannot read it ({e.strerror})") from None
    if len(data) > limit:
        raise FileError(f"{name}: over the size limit of {limit:,} bytes")
    return data


def read_text(path, limit, what="", encoding="utf-8"):
    """A regular file of at most limit bytes as UTF-8 text; else FileError naming the file."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        name = f"{what} {path}".strip()
        where = f"byte {data[e.start]:#04x} at offset {e.start}"
        raise FileError(f"{name}: not UTF-8 text ({where})") from None


# YAML 1.2 reads 1.0e9, 1e-3 and 2E5 as numbers; PyYAML (YAML 1.1) wants a dot and a signed
# exponent, else leaves them strings
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases and reads YAML 1.2's exponent floats."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            where = f"line {event.start_mark.line + 1}"
            raise yaml.YAMLError(f"{where}: an alias (*{event.anchor}); aliases are not accepted")
        return super().compose_node(parent, index)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+.0123456789"))


def read_yaml(path, what=""):
    """The object of a YAML file read by `read_text` (at most MAX_YAML_BYTES) without aliases;
    FileError naming the file if it cannot be read or is not valid YAML."""
    text = read_text(path, MAX_YAML_BYTES, what, encoding="utf-8-sig")
    try:
        return yaml.load(text, Loader=_Loader)
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        # ValueError: an integer of over 4300 digits; RecursionError: brackets nested too deep
        # a stripped message's first line is empty only if the whole message is
        first = first_line(str(e).strip()) or type(e).__name__
        name = f"{what} {path}".strip()
        raise FileError(f"{name}: not valid YAML ({first[:200]})") from None


def first_line(text):
    """The first line of str(text) ("" if none)."""
    return (str(text).splitlines() or [""])[0]


def replace_file(path, write):
    """write(a temporary file beside path), then rename it over path: a file or link already at
    path is replaced, never written through, and no half-written file is left."""
    # short, whatever path's length; one file at a time in a process
    tmp = path.with_name(f".yolo_min-{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
