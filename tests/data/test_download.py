"""lora_bench.download against a local HTTP server: fallbacks, interrupted transfers, size and
hash checks, skipping complete files, and zip extraction that refuses path traversal."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest
from conftest import refused_url

from lora_bench.download import download_file, safe_extract_zip
from lora_bench.errors import DataError, DownloadError

PAYLOAD = os.urandom(200_000) + b"end"  # several chunks, so streaming is exercised
SHA = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def server(http_server):
    return http_server


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".part" in p.name)


def test_success_writes_verified_file_and_no_part(server, tmp_path):
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    dest = tmp_path / "sub" / "file.bin"
    out = download_file([server.url + "/file.bin"], dest, expected_size=len(PAYLOAD), sha256=SHA,
                        progress=True)  # not a terminal under pytest: bar disabled, path exercised
    assert out == dest and dest.read_bytes() == PAYLOAD
    assert _leftovers(dest.parent) == []


@pytest.mark.parametrize("first", ["404", "refused"])
def test_falls_back_to_next_url(server, tmp_path, first):
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    primary = server.url + "/gone.bin" if first == "404" else refused_url()
    dest = tmp_path / "file.bin"
    download_file([primary, server.url + "/file.bin"], dest, progress=False, timeout=5)
    assert dest.read_bytes() == PAYLOAD
    assert server.hits["/file.bin"] == 1
    if first == "404":
        assert server.hits["/gone.bin"] == 1


def test_interrupted_transfer_is_detected(server, tmp_path):
    server.routes["/file.bin"] = ("truncate", PAYLOAD)
    dest = tmp_path / "file.bin"
    with pytest.raises(DownloadError) as err:
        download_file([server.url + "/file.bin"], dest, progress=False, timeout=5)
    msg = str(err.value)
    assert "interrupted" in msg and server.url + "/file.bin" in msg
    assert not dest.exists() and _leftovers(tmp_path) == []


def test_all_urls_fail_names_each_and_offline_fix(server, tmp_path):
    dead = refused_url()
    dest = tmp_path / "file.bin"
    with pytest.raises(DownloadError) as err:
        download_file([server.url + "/nope.bin", dead], dest, progress=False, timeout=5)
    msg = str(err.value)
    assert server.url + "/nope.bin" in msg and "404" in msg
    assert dead in msg and "cannot connect" in msg
    assert str(dest) in msg and "--data-file" in msg
    assert not dest.exists()


def test_expected_size_mismatch(server, tmp_path):
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    dest = tmp_path / "file.bin"
    with pytest.raises(DownloadError, match=f"expected {len(PAYLOAD) + 1}"):
        download_file([server.url + "/file.bin"], dest, expected_size=len(PAYLOAD) + 1, progress=False)
    assert not dest.exists() and _leftovers(tmp_path) == []


def test_bad_sha256(server, tmp_path):
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    dest = tmp_path / "file.bin"
    with pytest.raises(DownloadError, match="sha256"):
        download_file([server.url + "/file.bin"], dest, sha256="0" * 64, progress=False)
    assert not dest.exists() and _leftovers(tmp_path) == []


def test_corrupt_mirror_then_good_one(server, tmp_path):
    server.routes["/bad.bin"] = ("ok", PAYLOAD[:-1] + b"X")
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    dest = tmp_path / "file.bin"
    download_file([server.url + "/bad.bin", server.url + "/file.bin"], dest, sha256=SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD


def test_skips_complete_file_without_request(server, tmp_path):
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    dest = tmp_path / "file.bin"
    dest.write_bytes(PAYLOAD)
    for kwargs in ({}, {"expected_size": len(PAYLOAD)}, {"sha256": SHA}):
        download_file([server.url + "/file.bin"], dest, progress=False, **kwargs)
    assert server.hits["/file.bin"] == 0


def test_replaces_existing_file_that_does_not_match(server, tmp_path):
    server.routes["/file.bin"] = ("ok", PAYLOAD)
    dest = tmp_path / "file.bin"
    dest.write_bytes(b"old and short")
    download_file([server.url + "/file.bin"], dest, sha256=SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD and server.hits["/file.bin"] == 1


def _zip(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)  # writestr keeps the name verbatim (incl. '..' and '/')
    return path


def test_zip_extracts_normal_members(tmp_path):
    archive = _zip(tmp_path / "a.zip", {"SMSSpamCollection": b"ham\thi\n", "readme.txt": b"r",
                                        "sub/x.txt": b"x"})
    out = tmp_path / "out"
    paths = safe_extract_zip(archive, out)
    assert sorted(p.relative_to(out).as_posix() for p in paths) == ["SMSSpamCollection", "readme.txt",
                                                                    "sub/x.txt"]
    assert (out / "sub" / "x.txt").read_bytes() == b"x"
    only = safe_extract_zip(archive, tmp_path / "only", members=["SMSSpamCollection"])
    assert [p.name for p in only] == ["SMSSpamCollection"]
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == ["SMSSpamCollection"]


@pytest.mark.parametrize("evil", ["../evil.txt", "/tmp/evil_abs.txt", "sub/../../evil.txt"])
def test_zip_refuses_escaping_members(tmp_path, evil):
    archive = _zip(tmp_path / "evil.zip", {"good.txt": b"g", evil: b"pwned"})
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        safe_extract_zip(archive, out)
    assert repr(evil) in str(err.value)
    assert not (tmp_path / "evil.txt").exists() and not (out / "good.txt").exists()  # nothing written


def test_zip_missing_member_and_bad_archive(tmp_path):
    archive = _zip(tmp_path / "a.zip", {"x.txt": b"x"})
    with pytest.raises(DataError, match="'SMSSpamCollection'"):
        safe_extract_zip(archive, tmp_path / "out", members=["SMSSpamCollection"])
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="bad.zip"):
        safe_extract_zip(bad, tmp_path / "out")
