"""`depthkit data prepare` on a corpus as people hold one: JSONL (.gz, .zst), parquet and text files
in one run, made here from the bundled corpus (the Python 3.11 documentation sources).

What is held: every document arrives, in order, in the split a seeded hash of its file and row
gives it (decoded from the shards, it is the document); the output is byte-identical for 1, 2 and
3 threads; adding a file moves no other document; malformed records stop the run naming the file
and line or row (nothing written), or are counted with --skip-bad; a prepare killed mid-way leaves
no shard visible and runs again to the same bytes; a Hugging Face tokenizer.json prepares shards
whose ids are the `tokenizers` package's.
"""
import gzip
import json
import pathlib
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import read_shard, split_documents

SOURCES = pathlib.Path("/usr/share/doc/python3.11/html/_sources")  # python3.11-doc


def run(program, *args, ok=True, cwd=None):
    done = subprocess.run([program, *map(str, args)], capture_output=True, text=True, cwd=cwd)
    if ok and done.returncode != 0:
        pytest.fail(f"depthkit {' '.join(map(str, args))} exited {done.returncode}: {done.stderr.strip()}")
    return done


def split_ids(out, split):
    meta = json.loads((out / "meta.json").read_text())
    ids = []
    for name in meta["splits"][split]["shards"]:
        ids += read_shard(out / name)
    return ids


def texts(n, skip=0):
    files = sorted(SOURCES.rglob("*.txt"))[skip:skip + n]
    return [f.read_text(encoding="utf-8") for f in files]


def tree_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four kinds of file, 120 documents: (file key, row, text) of each, in reading order."""
    root = tmp_path_factory.mktemp("corpus")
    docs = texts(120)
    expected = []
    # JSONL.gz with FineWeb's extra fields, two gzip members (as `cat a.gz b.gz` makes)
    lines = [json.dumps({"id": f"a{i}", "text": t, "url": "x", "score": 0.5}) for i, t in enumerate(docs[:40])]
    blob = gzip.compress(("\n".join(lines[:20]) + "\n").encode()) + gzip.compress(("\n".join(lines[20:]) + "\n").encode())
    (root / "a.jsonl.gz").write_bytes(blob)
    expected += [("a.jsonl.gz", i + 1, t) for i, t in enumerate(docs[:40])]
    # JSONL.zst, CRLF line ends, no newline after the last line
    lines = [json.dumps({"text": t}) for t in docs[40:70]]
    (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("\r\n".join(lines).encode()))
    expected += [("b.jsonl.zst", i + 1, t) for i, t in enumerate(docs[40:70])]
    # parquet, two row groups, an extra column, large_string text
    table = pa.table({"id": list(range(30)), "text": pa.array(docs[70:100], type=pa.large_string())})
    pq.write_table(table, root / "c.parquet", row_group_size=16)
    expected += [("c.parquet", i, t) for i, t in enumerate(docs[70:100])]
    # text files in a folder
    (root / "d").mkdir()
    for i, t in enumerate(docs[100:120]):
        (root / "d" / f"doc{i:02d}.txt").write_text(t, encoding="utf-8")
    # read as an --input directory: its files in path order, keys relative to it
    order = {"a.jsonl.gz": 0, "b.jsonl.zst": 1, "c.parquet": 2}
    expected = sorted(expected, key=lambda e: (order[e[0]], e[1]))
    expected += [(f"d/doc{i:02d}.txt", 0, t) for i, t in enumerate(docs[100:120])]
    return root, expected


def prepare(program, inputs, out, *extra, ok=True):
    return run(program, "data", "prepare", "--input", *inputs, "--out", out, "--vocab-size", 512,
               "--val-fraction", 0.2, "--shard-tokens", 20000, "--json", *extra, ok=ok)


def test_every_document_in_its_split_and_thread_count_invariant(depthkit_program, corpus, tmp_path):
    root, expected = corpus
    outs = {}
    for threads in (1, 2, 3):
        out = tmp_path / f"out{threads}"
        summary = json.loads(prepare(depthkit_program, [root], out, "--threads", threads).stdout)
        outs[threads] = tree_bytes(out)
    assert outs[1] == outs[2] == outs[3], "the output depends on --threads"
    out = tmp_path / "out1"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer_type"] == "sentencepiece-bpe-byte-fallback"
    assert len(meta["splits"]["train"]["shards"]) > 1, "the corpus should fill several shards of 20,000 tokens"
    assert summary["train_documents"] + summary["val_documents"] == len(expected)

    # The split each document must land in: the hash depthkit documents (docs/data.md), recomputed.
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    eos = meta["eos_id"]
    for split in ("train", "val"):
        got = [sp.decode(d) for d in split_documents(split_ids(out, split), eos)]
        want = [t for key, row, t in expected if (split == "val") == is_val(42, key, row, 0.2)]
        assert got == want, f"the {split} split's documents differ from the inputs'"
    assert meta["documents"] == len(expected)


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return state, z ^ (z >> 31)


def document_hash(seed, key, row):
    h = 0xCBF29CE484222325
    for c in key.encode():
        h = ((h ^ c) * 0x100000001B3) & (2**64 - 1)
    _, x = splitmix64(seed ^ h)
    _, y = splitmix64(x ^ (row & (2**64 - 1)))
    return y


def is_val(seed, key, row, fraction):
    return (document_hash(seed, key, row) >> 11) * 2.0**-53 < fraction


def test_adding_a_file_moves_no_document(depthkit_program, corpus, tmp_path):
    root, expected = corpus
    tok = tmp_path / "first"
    prepare(depthkit_program, [root / "a.jsonl.gz", root / "c.parquet"], tok)
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(10, skip=200)))
    second = tmp_path / "second"
    prepare(depthkit_program, [root / "a.jsonl.gz", extra, root / "c.parquet"], second,
            "--tokenizer", tok / "tokenizer.model")
    eos = json.loads((tok / "meta.json").read_text())["eos_id"]
    for split in ("train", "val"):
        before = split_documents(split_ids(tok, split), eos)
        after = split_documents(split_ids(second, split), eos)
        assert all(d in after for d in before), f"adding a file moved a {split} document"


@pytest.mark.parametrize("name,content,where,why", [
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', "bad.jsonl line 3", "not valid JSON"),
    ("bad.jsonl", b'{"text": "a"}\n{"body": "b"}\n', "bad.jsonl line 2", 'no field "text"'),
    ("bad.jsonl", b'{"text": 5}\n', "bad.jsonl line 1", "is a number, not a string"),
    ("bad.jsonl", b'{"text": null}\n', "bad.jsonl line 1", "is null, not a string"),
    ("bad.jsonl", b'[1, 2]\n', "bad.jsonl line 1", "not an object"),
    ("bad.jsonl", b'{"text": "a"}\n\n{"text": "b"}\n', "bad.jsonl line 2", "empty line"),
    ("bad.jsonl", b'{"text": "caf\xe9"}\n', "bad.jsonl line 1", "not valid JSON (or not valid UTF-8)"),
    ("bad.txt", b"fine text \xff\xfe then", "bad.txt", "invalid UTF-8 at byte 10"),
    ("bad.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "bad.jsonl.gz", "not a valid gzip file"),
    ("bad.jsonl.zst", zstandard.ZstdCompressor().compress(b'{"text": "a"}\n' * 100)[:-5], "bad.jsonl.zst",
     "truncated zstd file"),
    ("bad.parquet", b"PAR1 not really", "bad.parquet", "cannot read it as parquet"),
])
def test_malformed_records_are_named(depthkit_program, corpus, tmp_path, name, content, where, why):
    root, _ = corpus
    bad = tmp_path / name
    bad.write_bytes(content)
    out = tmp_path / "out"
    done = prepare(depthkit_program, [root / "a.jsonl.gz", bad], out, ok=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert where in lines[-1] and why in lines[-1], lines[-1]
    assert not out.exists() and not list(tmp_path.glob("out.partial-*")), "a failed prepare left files behind"


def test_skip_bad_counts_and_goes_on(depthkit_program, corpus, tmp_path):
    root, _ = corpus
    bad = tmp_path / "mixed.jsonl"
    bad.write_text('{"text": "one"}\n{"text": 1}\nnot json\n{"text": "two"}\n{"other": "x"}\n')
    table = pa.table({"text": pa.array(["x", None, "y"])})
    pq.write_table(table, tmp_path / "nulls.parquet")
    out = tmp_path / "out"
    done = prepare(depthkit_program, [root / "a.jsonl.gz", bad, tmp_path / "nulls.parquet"], out, "--skip-bad")
    summary = json.loads(done.stdout)
    assert summary["bad_records_skipped"] == 4
    assert "skipped 4 malformed records" in done.stderr
    assert summary["train_documents"] + summary["val_documents"] == 40 + 2 + 2


def test_parquet_column_errors(depthkit_program, corpus, tmp_path):
    root, _ = corpus
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "other.parquet")
    done = prepare(depthkit_program, [root / "a.jsonl.gz", tmp_path / "other.parquet"], tmp_path / "o", ok=False)
    assert "other.parquet: no column 'text' (--text-key); its columns: content" in done.stderr
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    done = prepare(depthkit_program, [root / "a.jsonl.gz", tmp_path / "ints.parquet"], tmp_path / "o", ok=False)
    assert "ints.parquet: column 'text' holds int64, not strings" in done.stderr
    done = prepare(depthkit_program, [tmp_path / "other.parquet", root / "c.parquet"], tmp_path / "o", "--text-key",
                   "content", ok=False)
    assert "c.parquet: no column 'content'" in done.stderr


def test_killed_prepare_leaves_no_shard_and_runs_again(depthkit_program, corpus, tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(400)))
    tok = tmp_path / "tok"
    prepare(depthkit_program, [big], tok, "--threads", 1)  # the tokenizer the killed runs use
    out = tmp_path / "out"
    args = [depthkit_program, "data", "prepare", "--input", big, "--out", out, "--val-fraction", 0.2,
            "--shard-tokens", 4096, "--threads", 1, "--tokenizer", tok / "tokenizer.model"]
    proc = subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    partial = None
    while time.time() < deadline and proc.poll() is None:
        found = [p for p in tmp_path.glob("out.partial-*") if list(p.glob("train_*.bin"))]
        if found:
            partial = found[0]
            break
        time.sleep(0.005)
    assert partial is not None, "prepare finished before a shard was written: make the corpus bigger"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    for shard in partial.glob("*.bin"):
        read_shard(shard)  # every visible shard is complete (its size matches its header)
    done = run(depthkit_program, *args[1:])
    assert "left by an interrupted prepare" in done.stderr
    assert not partial.exists()
    clean = tmp_path / "clean"
    run(depthkit_program, *[a if a != out else clean for a in args[1:]])
    assert tree_bytes(out) == tree_bytes(clean)


def test_tokenizer_sample_is_bounded_and_seeded(depthkit_program, corpus, tmp_path):
    root, _ = corpus
    a = json.loads(prepare(depthkit_program, [root], tmp_path / "a", "--tokenizer-sample-bytes", 200000).stdout)
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    sample = meta["tokenizer_sample"]
    assert 0 < sample["bytes"] <= 200000 and sample["documents"] < a["train_documents"]
    prepare(depthkit_program, [root], tmp_path / "b", "--tokenizer-sample-bytes", 200000, "--threads", 1)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_tokenizer_json_prepares_tokenizers_ids(depthkit_program, corpus, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root, expected = corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t for _, _, t in expected[:60]], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "out"
    prepare(depthkit_program, [root], out, "--tokenizer", path)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["tokenizer_type"] == "hf-byte-level-bpe"
    eos = tok.token_to_id("<|endoftext|>")
    assert meta["eos_id"] == eos
    tok.encode_special_tokens = True  # a document's text is text (llm.c's encode_ordinary)
    for split in ("train", "val"):
        got = split_documents(split_ids(out, split), eos)
        want = [tok.encode(t, add_special_tokens=False).ids for key, row, t in expected
                if (split == "val") == is_val(42, key, row, 0.2)]
        assert got == want, f"{split}: the shards' ids differ from the tokenizers package's"


def test_sentencepiece_ids_equal_the_python_package(depthkit_program, corpus, tmp_path):
    """The C++ encoder (line by line, each line word by word through a per-thread cache: docs/data.md)
    gives the ids the sentencepiece package gives line by line (depthkit.tokenizer, no cache)."""
    from depthkit.tokenizer import Tokenizer
    root, expected = corpus
    out = tmp_path / "out"
    prepare(depthkit_program, [root], out)
    model = out / "tokenizer.model"
    lines = [t for _, _, t in expected] + [
        "", " ", "  ", "a  b   c", "  leading", "trailing  ", "\ttab\t and  space", "x" * 200, "9" * 300,
        " ".join(["word"] * 500), "naïve café 東京 🙂 \u3000 wide\u3000space", "\u00a0nbsp\u00a0", "a\r\nb\n\n\nc ",
        "def f(x):\n    return  x  *  2\n", "<|endoftext|> is text", " " * 1000 + "end",
    ]
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(t) + "\n" for t in lines))
    done = run(depthkit_program, "data", "encode", "--tokenizer", model, "--input", tmp_path / "lines.jsonl")
    got = [json.loads(line)["ids"] for line in done.stdout.splitlines()]
    tok = Tokenizer(model)
    for text, ids in zip(lines, got, strict=True):
        assert ids == tok.encode(text), f"{text[:80]!r}: depthkit's ids differ from sentencepiece's"


def test_a_model_on_tokenizer_json_shards_generates_and_is_scored(depthkit_program, corpus, tmp_path):
    """Shards made with a tokenizer.json train a model that generate, eval --task and depthkit.load
    read text with, through that tokenizer; llm.c-style shards (no meta.json) with the tokenizer.json
    beside them too."""
    import shutil
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import depthkit
    root, expected = corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([t for _, _, t in expected], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    data = tmp_path / "data"
    prepare(depthkit_program, [root], data, "--tokenizer", tmp_path / "tokenizer.json")
    config = tmp_path / "gpt.toml"
    config.write_text(
        "[model]\nn_layers = 1\nd_model = 32\nn_heads = 4\nn_kv_heads = 2\nd_ff = 64\nvocab_size = 640\nseq_len = 32\n"
        f"[residual]\nkind = \"dar\"\nblock_sublayers = 2\n[data]\ndir = \"{data}\"\n[train]\nmicro_batch = 2\n"
        "steps = 3\neval_every = 0\neval_tokens = 64\ncheckpoint_every = 3\nlog_every = 1\nthreads = 1\n"
        "[optim]\nwarmup_steps = 1\n")
    run_dir = tmp_path / "run"
    run(depthkit_program, "train", "--config", config, "--run-dir", run_dir)
    prompt = "The list naïve 🙂"
    g = json.loads(run(depthkit_program, "generate", "--run-dir", run_dir, "--prompt", prompt, "--max-new-tokens", 6,
                       "--temperature", 0, "--json").stdout)
    assert g["prompt_tokens"] == 1 + len(tok.encode(prompt, add_special_tokens=False).ids)  # eos, then the prompt
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "The list", "choices": [" is", " was"], "gold": 0}\n'
                    '{"context": "A tuple", "choices": [" is", " of"], "gold": 1}\n')
    scored = json.loads(run(depthkit_program, "eval", "--run-dir", run_dir, "--task", task, "--json").stdout)
    assert scored["items"] == 2, scored
    model = depthkit.load(run_dir)
    assert model.tokenizer.path == data / "tokenizer.json" and model.tokenizer.eos_id == tok.token_to_id("<|endoftext|>")
    assert model.tokenizer.encode(prompt) == tok.encode(prompt, add_special_tokens=False).ids
    # llm.c's layout: shards named fineweb_*, no meta.json, the tokenizer.json beside them
    llmc = tmp_path / "llmc"
    llmc.mkdir()
    shutil.copy(data / "train_000000.bin", llmc / "fineweb_train_000000.bin")
    shutil.copy(data / "val_000000.bin", llmc / "fineweb_val_000000.bin")
    shutil.copy(tmp_path / "tokenizer.json", llmc / "tokenizer.json")
    g2 = json.loads(run(depthkit_program, "generate", "--run-dir", run_dir, "--data", llmc, "--prompt", prompt,
                        "--max-new-tokens", 6, "--temperature", 0, "--json").stdout)
    assert g2["text"] == g["text"]
