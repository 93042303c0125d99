"""bench/workload.py: held-out prompts."""
from __future__ import annotations

import zlib

import pytest

from bench.workload import held_out_texts, is_held_out, select_prompts


def test_is_held_out_matches_the_training_split():
    paths = [f"pkg{i}/mod{i}.py" for i in range(400)]
    held = [p for p in paths if is_held_out(p)]
    assert held == [p for p in paths if zlib.crc32(p.encode()) % 20 == 0]
    assert 0 < len(held) < len(paths) // 5


def test_held_out_texts_skips_training_files_and_site_packages(tmp_path):
    names = [f"m{i}.py" for i in range(200)]
    for name in names:
        (tmp_path / name).write_text(f"x = {name!r}\n")
    (tmp_path / "site-packages").mkdir()
    held_site = next(f"site-packages/s{i}.py" for i in range(1000) if is_held_out(f"site-packages/s{i}.py"))
    (tmp_path / held_site).write_text("y = 1\n")
    texts = held_out_texts(tmp_path)
    assert sorted(texts) == sorted(n for n in names if is_held_out(n))
    assert all(texts[n] == f"x = {n!r}\n" for n in texts)


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character


def test_select_prompts_cuts_whole_lines_of_enough_tokens():
    texts = {f"f{i}.py": "".join(f"line {i}-{j}\n" for j in range(50)) for i in range(3)}
    prompts = select_prompts(texts, _encode, num_prompts=7, prompt_tokens=30, seed=1)
    assert len(prompts) == 7
    for p in prompts:
        name, line = p.source.split(":")
        assert p.text in texts[name] and p.text.endswith("\n")
        assert texts[name].splitlines(keepends=True)[int(line) - 1] == p.text.splitlines(keepends=True)[0]
        assert len(p.token_ids) >= 30 and len(_encode(p.text.splitlines(keepends=True)[0])) < 30 + 12
        assert p.token_ids == _encode(p.text)
    assert prompts == select_prompts(texts, _encode, num_prompts=7, prompt_tokens=30, seed=1)
    assert prompts != select_prompts(texts, _encode, num_prompts=7, prompt_tokens=30, seed=2)


def test_select_prompts_fails_loudly_when_the_texts_are_too_short():
    with pytest.raises(ValueError, match="only 0 of 2 prompts"):
        select_prompts({"a.py": "x = 1\n"}, _encode, num_prompts=2, prompt_tokens=100)
    with pytest.raises(ValueError, match="num_prompts"):
        select_prompts({"a.py": "x = 1\n"}, _encode, num_prompts=0, prompt_tokens=1)
