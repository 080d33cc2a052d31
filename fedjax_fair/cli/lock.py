"""Who owns a run's folders: an OS advisory lock and the run's configuration fingerprint.

* **Lock.** A process that writes a run holds ``fcntl.flock`` on ``LOCK_NAME`` in its
  output directory (and in its checkpoint directory when that lies elsewhere) for its
  whole life. The kernel drops the lock when the process exits or is killed (SIGKILL
  included), so a dead run never leaves a stale lock; the file stays and holds the last
  holder's pid, host, command and start time, which a refused second writer names.
* **Fingerprint.** A hash of the canonical configuration fields that change a run's
  iterates (algorithm, hyper-parameters, data and its arguments, model and its
  arguments, seed, ...) and of the contents of the files the run reads
  (``input_hashes``: a ``--availability trace:FILE``, a LEAF dataset's JSON files;
  recorded under ``INPUTS_KEY``, only when there are any, so the fingerprint of a run
  without input files is the one it always had). ``run`` records it in ``config.json``
  and in ``FINGERPRINT_NAME`` beside the checkpoint; ``--resume`` refuses a config.json
  or a checkpoint folder whose fingerprint does not match, naming the fields that
  differ, and an input file whose contents changed, naming its option
  (``common._record_inputs``).
"""
from __future__ import annotations

import datetime
import errno
import glob
import hashlib
import json
import os
import socket
import sys
from typing import Optional, Sequence

from fedjax_fair.cli import options as O

LOCK_NAME = ".fedjax-fair.lock"
FINGERPRINT_NAME = "fingerprint.json"

def _content(path: str) -> list:
    return [n for n in os.listdir(path) if n != LOCK_NAME] if os.path.isdir(path) else []


def holder(path: str) -> Optional[str]:
    """A description of the process holding ``path``'s lock, or None when nobody holds
    it (nothing is created)."""
    import fcntl
    lock = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _describe(lock)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _describe(lock: str) -> str:
    try:
        with open(lock) as f:
            info = json.load(f)
        return (f"pid {info.get('pid')} on {info.get('host')}, started "
                f"{info.get('started')}: {info.get('command')}")
    except (OSError, ValueError, AttributeError):
        return "another process"


class Held:
    """The locks this process holds (kept open for the process's life); ``release``
    undoes what ``acquire`` created when the command is refused before writing."""

    def __init__(self, command: Optional[Sequence[str]] = None):
        self.command = list(sys.argv[1:] if command is None else command)
        self.fds: list = []
        self.previous: list = []  # (lock file, its content, its times) before acquire
        self.created: list = []  # (path, what) in creation order: "dir" or "file"

    def acquire(self, path: str, field: str) -> None:
        import fcntl
        path = os.path.abspath(path)
        made = []
        parent = path
        while not os.path.exists(parent):
            made.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(path, exist_ok=True)
        lock = os.path.join(path, LOCK_NAME)
        existed = os.path.exists(lock)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                # a file system without flock (some network mounts): run unlocked
                print(f"warning: {field}: cannot lock {lock} ({e.strerror}); another "
                      f"writer would not be refused", file=sys.stderr)
            else:
                os.close(fd)
                fd = None
        if fd is None:
            who = _describe(lock)
            if not existed:
                _remove(lock)
            for d in made:
                _rmdir(d)
            raise O.ConfigError(field, f"{path!r} is in use by {who}; wait for it to end or "
                                       f"choose another directory") from None
        self.created += [(d, "dir") for d in reversed(made)]
        if not existed:
            self.created.append((lock, "file"))
        else:  # the last holder's record, put back if this command is refused
            st = os.fstat(fd)
            self.previous.append((lock, os.pread(fd, st.st_size, 0),
                                  (st.st_atime_ns, st.st_mtime_ns)))
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "command": " ".join(["fedjax-fair", *map(str, self.command)]),
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fds.append(fd)

    def release(self, undo: bool = False) -> None:
        """Drops the locks; ``undo``: also removes the lock files and directories that
        ``acquire`` created (a refused command leaves its folders as they were)."""
        import fcntl
        if undo:
            for path, content, times in self.previous:
                try:
                    with open(path, "r+b") as f:
                        f.write(content)
                        f.truncate()
                    os.utime(path, ns=times)
                except OSError:
                    pass
        for fd in self.fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass  # never locked (a file system without flock)
            os.close(fd)
        self.fds = []
        if undo:
            for path, what in reversed(self.created):
                _remove(path) if what == "file" else _rmdir(path)
        self.created, self.previous = [], []


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)  # only an empty directory
    except OSError:
        pass


def check_not_held(path: Optional[str], field: str) -> None:
    """Refuses (``field``) a directory another process holds."""
    if path:
        who = holder(path)
        if who:
            raise O.ConfigError(field, f"{os.path.abspath(path)!r} is in use by {who}; wait "
                                       f"for it to end or choose another directory")


def holds_results(path: str) -> bool:
    """``path`` holds anything besides the lock file."""
    return bool(_content(path))


# ------------------------------------------------------------------------ fingerprint


def iterate_config(cfg_dict: dict) -> dict:
    """The fields of a saved or new config that change the run's iterates."""
    return {k: O.canonical(v) for k, v in sorted(cfg_dict.items())
            if k not in O.NOT_ITERATES
            and not (k in O.LATER_DEFAULTS and O.canonical(v) == O.LATER_DEFAULTS[k])}


# ------------------------------------------------------------------------ input files

INPUTS_KEY = "inputs"
"""config.json's record of the run's input files: {option field: "sha256:<hex>"}."""
CHUNK = 1 << 20  # bytes read at a time when hashing


def _trace_file(cfg_dict: dict) -> Optional[tuple]:
    """``--availability trace:FILE`` (as ``parsing.parse_system`` reads it)."""
    kind, _, rest = str(cfg_dict.get("availability") or "always").strip().partition(":")
    return (rest, None) if kind == "trace" and rest else None


def _leaf_files(cfg_dict: dict) -> Optional[tuple]:
    """A LEAF dataset's ``path``: the ``*.json`` files of its ``train/`` and ``test/``,
    what ``data.leaf.load_leaf`` reads (``read_leaf_dir``)."""
    from fedjax_fair.data.builders import LEAF_DATASETS
    path = (cfg_dict.get("dataset_args") or {}).get("path")
    if cfg_dict.get("dataset") not in LEAF_DATASETS or not isinstance(path, str) or not path:
        return None
    root = os.path.expanduser(path)
    return root, [f for split in ("train", "test")
                  for f in sorted(glob.glob(os.path.join(glob.escape(root), split, "*.json")))]


def _prepared_files(cfg_dict: dict) -> Optional[tuple]:
    """A prepared federation's ``path`` (``--dataset disk``): its ``federation.json``,
    which records the sha256 of every array file ``fedjax-fair prepare`` wrote (the
    arrays, gigabytes at scale, are not read again; ``disk.read`` checks their sizes)."""
    from fedjax_fair.data.disk import MANIFEST
    path = (cfg_dict.get("dataset_args") or {}).get("path")
    if cfg_dict.get("dataset") != "disk" or not isinstance(path, str) or not path:
        return None
    root = os.path.expanduser(path)
    return root, [os.path.join(root, MANIFEST)]


def _dataset_files(cfg_dict: dict) -> Optional[tuple]:
    return _leaf_files(cfg_dict) or _prepared_files(cfg_dict)


INPUTS = (("availability", _trace_file), ("dataset_args.path", _dataset_files))
"""Every option that names files a run reads: (its field, ``(root, files)`` of a config
dict: a file alone is ``(path, None)``, a folder its root and the files read in it, in
reading order). A ``--config`` file is not one: its values are the config. TFDS
datasets are not hashed: a prepared TFDS dataset is versioned by TFDS (the version is
part of the dataset's name) and can be hundreds of GiB."""


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def content_hash(root: str, files: Optional[Sequence[str]] = None) -> str:
    """``"sha256:<hex>"`` of a file's contents (``files`` None), or of a folder's: the
    sorted relative paths of ``files`` (under ``root``) each with its contents'
    digest; read in chunks of ``CHUNK`` bytes."""
    if files is None:
        return "sha256:" + _file_digest(root)
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: os.path.relpath(f, root)):
        rel = os.path.relpath(f, root).replace(os.sep, "/")
        h.update(f"{rel}\0{_file_digest(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def input_files(cfg_dict: dict) -> dict:
    """{field: (root, files)} of every input a config reads (``INPUTS``)."""
    found = {field: find(cfg_dict) for field, find in INPUTS}
    return {field: f for field, f in found.items() if f is not None}


def input_hashes(cfg_dict: dict) -> dict:
    """{field: ``content_hash``} of every input a config reads (``input_files``) that
    can be read now; one that cannot is left out for its loader to report."""
    out = {}
    for field, (root, files) in input_files(cfg_dict).items():
        try:
            out[field] = content_hash(root, files)
        except OSError:
            continue
    return out


def fingerprint(cfg_dict: dict) -> str:
    text = json.dumps(iterate_config(cfg_dict), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(old: dict, new: dict) -> list:
    """``field (old -> new)`` for every iterate field that differs."""
    a, b = iterate_config(old), iterate_config(new)
    return [f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def record(path: str, cfg_dict: dict) -> None:
    """Writes ``FINGERPRINT_NAME`` (the fingerprint and the iterate fields) in ``path``."""
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, FINGERPRINT_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"fingerprint": fingerprint(cfg_dict), "config": iterate_config(cfg_dict)},
                  f, indent=1, default=str)
    os.replace(tmp, os.path.join(path, FINGERPRINT_NAME))


def read(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, FINGERPRINT_NAME)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
