"""Publishing a checkpoint folder durably: the verified temporary folder renamed into place,
`latest_checkpointed_iteration.txt` rewritten atomically, debris of interrupted saves and
checkpoints past --keep-last removed. Nothing already published is removed before its
replacement is in place (fsync of the files and of the folder, then rename)."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil

from checkpoint.format import LATEST, complete_checkpoints, debris, iter_dir_name


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, text: str) -> None:
    """Write `path` atomically: temp file, fsync, os.replace, fsync the folder."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def publish_folder(tmp: str, root: str, iteration: int) -> str:
    """Rename the verified `tmp` to `root/iter_XXXXXXX` and point `latest` at it. An existing
    folder of the same iteration (a save that completed after the marker was last written) is
    moved aside first and removed only once the new one is in place."""
    final = os.path.join(root, iter_dir_name(iteration))
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{secrets.token_hex(4)}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    write_synced(os.path.join(root, LATEST), f"{iteration}\n")
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_debris(root: str, when: str) -> list[str]:
    """Delete what interrupted saves left in `root` (`checkpoint.format.debris`), with one
    log line; returns the paths removed."""
    found = debris(root)
    for path in found:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    if found:
        print(f"removed {len(found)} leftover(s) of interrupted saves {when}: "
              f"{', '.join(os.path.basename(p) for p in found)} (in {root})", flush=True)
    return found


def prune(root: str, keep_last: int | None) -> None:
    """Keep the newest `keep_last` complete checkpoints (the one `latest` names always) and
    remove debris of interrupted saves (the save just published was the only live one)."""
    if not keep_last:
        return
    remove_debris(root, "(--keep-last)")
    latest = open(os.path.join(root, LATEST)).read().strip()
    for it, path in complete_checkpoints(root)[:-keep_last]:
        if str(it) != latest:
            shutil.rmtree(path, ignore_errors=True)
