"""The disk tier's file against its neighbours (``tiercache.tiers.disk_claim``): a
directory another user owns or may write (a real second local user), a name planted by
them, ``/dev/shm``, a second coordinator on the same file (a real process holding it), a
file copied from another instance or a slot transplanted from one, and a header whose
seq is the largest there is (a real coordinator demotes past it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tiercache.errors import ConfigError
from tiercache.tiers.block_header import ALL_RANKS, BlockHeader, Container, checksum
from tiercache.tiers.disk_claim import FILE_HEADER_BYTES
from tiercache.tiers.disk_file import HEADER_BYTES, DiskSlotFile
from test_disk_file import DIGEST, ROW, filled, open_file, rows
from e2e_support import metrics_url
from test_disk_tier import KEYS, config, load_every_key, store_paced, tier  # noqa: F401
from tiercache.region.layout import RegionLayout
from tiercache.service.process import CoordinatorProcess
from users import other_user, shared_dir


@pytest.fixture
def other():
    yield from other_user()


def test_a_directory_another_user_owns_is_refused_even_through_a_symlink(other, tmp_path):
    with shared_dir(other) as theirs:
        os.chmod(theirs, 0o700)
        with pytest.raises(ConfigError, match=f"belongs to {other.name}"):
            open_file(theirs)
        link = tmp_path / "disk"
        link.symlink_to(theirs)
        with pytest.raises(ConfigError, match=f"disk.path = .* belongs to {other.name}"):
            open_file(str(link))
        assert os.listdir(theirs) == []  # nothing made there


def test_a_directory_others_may_write_is_refused_unless_sticky(other, tmp_path):
    with tempfile.TemporaryDirectory(prefix="tiercache-open-") as name:  # in /tmp: the
        check_open_directory(other, tmp_path, Path(name))  # other user can reach it


def check_open_directory(other, tmp_path: Path, open_dir: Path) -> None:
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match="writable by others .*0777.* not sticky"):
        open_file(str(open_dir))
    os.chmod(open_dir, 0o1777)  # like /tmp: only a file's owner may rename or remove it
    f = open_file(str(open_dir))
    f.close()
    os.unlink(f.path)
    planted = open_dir / "t.disk"  # the other user plants the file's name first
    other.run(["/usr/bin/touch", str(planted)]).check_returncode()
    with pytest.raises(ConfigError, match="not ours with mode 0600|cannot open it"):
        open_file(str(open_dir))
    os.unlink(planted)
    other.run(["/bin/ln", "-s", str(tmp_path / "elsewhere"), str(planted)]).check_returncode()
    with pytest.raises(ConfigError, match="cannot open it"):  # never followed (ELOOP, or
        open_file(str(open_dir))  # EACCES where the kernel protects sticky symlinks first)
    assert not (tmp_path / "elsewhere").exists()


def test_the_file_is_used_by_the_descriptor_checked_not_by_its_name(tmp_path):
    f = open_file(str(tmp_path), direct_io=False)
    os.rename(f.path, tmp_path / "moved.disk")  # someone swaps the name after the checks
    with open(f.path, "wb") as swapped:
        swapped.write(bytes(FILE_HEADER_BYTES + 4 * f.slot_bytes))
    f.write(1, b"k", 1, [memoryview(r) for r in filled(b"k")])
    assert f.read(1, b"k", [memoryview(r) for r in rows()])
    assert not any((tmp_path / "t.disk").read_bytes())  # the swapped-in file: untouched
    f.close()


@pytest.mark.parametrize("how", ["itself", "through a symlink"])
def test_dev_shm_is_refused(tmp_path, how):
    before = set(os.listdir("/dev/shm"))
    path = "/dev/shm"
    if how == "through a symlink":
        (tmp_path / "shm").symlink_to("/dev/shm")
        path = str(tmp_path / "shm")
    with pytest.raises(ConfigError, match="is /dev/shm, where the regions live"):
        open_file(path)
    assert set(os.listdir("/dev/shm")) - before == set()


HOLDER = """
import os, sys
from tiercache.tiers.disk_file import DiskSlotFile
f = DiskSlotFile(sys.argv[1], int(sys.argv[2]), world_size=2, row_stride=int(sys.argv[3]),
                 layout_digest=sys.argv[4].encode(), direct_io=False)
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_second_coordinator_on_the_file_gets_one_line_naming_the_holder(tmp_path):
    path = str(tmp_path / "t.disk")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path,
                               str(4 * (HEADER_BYTES + 2 * ROW)), str(ROW), DIGEST.decode()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(ConfigError) as refused:
            open_file(str(tmp_path))
        message = str(refused.value)
        assert "\n" not in message and path in message
        assert f"in use by another coordinator (pid {holder.pid} on host" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    again = open_file(str(tmp_path))  # the kernel dropped the lock with its holder
    assert again.fresh_reason == ""  # and its file is adopted as it was
    again.close()


def test_a_file_copied_from_another_instance_is_refused(tmp_path):
    a = DiskSlotFile(str(tmp_path / "tiercache-a.disk"), 4 * (HEADER_BYTES + 2 * ROW),
                     world_size=2, row_stride=ROW, layout_digest=DIGEST)
    a.write(0, b"k", 1, [memoryview(r) for r in filled(b"k")])
    a.close()
    shutil.copy(tmp_path / "tiercache-a.disk", tmp_path / "tiercache-b.disk")
    with pytest.raises(ConfigError, match="was made as 'tiercache-a.disk', not "
                                          "'tiercache-b.disk'"):
        DiskSlotFile(str(tmp_path / "tiercache-b.disk"), 4 * (HEADER_BYTES + 2 * ROW),
                     world_size=2, row_stride=ROW, layout_digest=DIGEST)


def test_a_slot_of_another_instances_file_is_never_served(tmp_path):
    """Two files of one name and geometry (two nodes' disks, or one path reused): a slot
    of the first moved into the second whole (header CRC and data CRC intact) is not the
    second's."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first, second = open_file(str(tmp_path / "one")), open_file(str(tmp_path / "two"))
    assert first.instance != second.instance
    first.write(0, b"k", 9, [memoryview(r) for r in filled(b"k")])
    with open(first.path, "rb") as src, open(second.path, "r+b") as dst:
        src.seek(first.offset(0))
        slot = src.read(first.slot_bytes)
        dst.seek(second.offset(2))
        dst.write(slot)
    assert first.read(0, b"k", [memoryview(r) for r in rows()])
    assert second.scan() == [] and not second.read(2, b"k", [memoryview(r) for r in rows()])
    first.close()
    second.close()


def test_a_file_of_another_format_or_geometry_starts_empty_and_says_why(tmp_path):
    f = open_file(str(tmp_path))
    assert f.fresh_reason == "a new file"
    f.write(0, b"k", 1, [memoryview(r) for r in filled(b"k")])
    f.close()
    other = open_file(str(tmp_path), digest=b"M" * 16)
    assert other.fresh_reason == "it was made for another block geometry"
    assert other.scan() == []
    other.close()
    with open(tmp_path / "t.disk", "r+b") as raw:  # an older format: a slot at offset 0
        raw.write(b"TCDISK01" + bytes(100))
    older = open_file(str(tmp_path))
    assert "header did not check" in older.fresh_reason and older.scan() == []
    older.close()


def largest_seq_slot(f: DiskSlotFile, key: bytes) -> bytes:
    """A slot of ``f``'s own instance, every CRC right, whose seq is 2**64 - 1."""
    data = [memoryview(r) for r in filled(key)]
    header = BlockHeader(Container.DISK_SLOT, f.layout_digest, f.instance, (1 << 64) - 1,
                         ALL_RANKS, f.world_size, f.world_size * f.row_stride,
                         checksum(data), key)
    return header.seal(None).ljust(HEADER_BYTES, b"\0") + b"".join(bytes(r) for r in data)


def test_a_header_with_the_largest_seq_is_not_whole(tmp_path):
    f = open_file(str(tmp_path), direct_io=False)
    raw = largest_seq_slot(f, b"k")
    with open(f.path, "r+b") as out:
        out.seek(f.offset(1))
        out.write(raw)
    assert f.scan() == [] and not f.read(1, b"k", [memoryview(r) for r in rows()])
    f.write(2, b"j", 7, [memoryview(r) for r in filled(b"j")])  # writes go on
    assert [(slot, h.seq) for slot, h in f.scan()] == [(2, 7)]
    f.close()


def test_a_coordinator_demotes_past_a_header_with_the_largest_seq(config, tmp_path):
    """The file holds one slot whose header checks and names seq 2**64 - 1 when the
    coordinator starts: its rebuild must not take the next seq from it (before: every
    demotion raised ``struct.error`` and the tier spilled nothing again)."""
    layout = RegionLayout.from_config(config)
    f = DiskSlotFile(config.disk.file_path(config.name), config.disk.capacity_bytes,
                     world_size=2, row_stride=layout.row_stride, layout_digest=layout.digest)
    with open(f.path, "r+b") as out:
        out.seek(f.offset(0))
        out.write(largest_seq_slot(f, b"planted"))
    f.close()
    with CoordinatorProcess(config, tmp_path / "c") as coordinator:
        url = metrics_url(coordinator)
        store_paced(config, url, KEYS)
        assert tier(url, "demotions_total") >= len(KEYS) // 2
        assert load_every_key(config, KEYS) == (len(KEYS), 0, 0)
        assert "struct.error" not in coordinator.output()


def test_a_symlink_under_the_files_name_is_never_followed(tmp_path):
    (tmp_path / "t.disk").symlink_to(tmp_path / "elsewhere.disk")
    with pytest.raises(ConfigError, match="cannot open it .*a symlink is never followed"):
        open_file(str(tmp_path))
    assert not (tmp_path / "elsewhere.disk").exists()
