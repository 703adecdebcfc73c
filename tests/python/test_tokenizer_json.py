"""depthkit's tokenizer.json reader (src/depthkit/data/hf_tokenizer.cpp) against the `tokenizers`
package, token for token: two byte-level BPE tokenizers are trained here (GPT-2 style and Llama-3
style) on the Python documentation's sources, saved as tokenizer.json (also with merges in the
legacy "a b" form), and `depthkit data encode` must give tokenizers' ids on real paragraphs and on
adversarial text (every Unicode category and plane, whitespace of every kind, long runs, special
tokens inside words, invalid UTF-8), and tokenizers' decode of them."""
import base64
import json
import pathlib
import random
import subprocess
import sys
import unicodedata

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

CORPUS = pathlib.Path("/usr/share/doc/python3.11/html/_sources")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TRAIN_BYTES = 3 << 20


def corpus_documents():
    if not CORPUS.is_dir():
        pytest.skip(f"{CORPUS}: the bundled corpus is not installed (python3.11-doc)")
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(CORPUS.rglob("*.txt"))]


@pytest.fixture(scope="module")
def documents():
    return corpus_documents()


def training_text(documents):
    out, size = [], 0
    for d in documents:
        out.append(d)
        size += len(d)
        if size > TRAIN_BYTES:
            break
    return out


def train_gpt2(documents):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=6000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(documents), trainer)
    # Non-special added tokens: one matched after normalization (the default), one whose content is
    # outside the byte alphabet's printable part (decode passes it through the byte map).
    tok.add_tokens(["hello world", AddedToken("naïve_added", normalized=False)])
    return tok


def train_llama3(documents):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(documents), trainer)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(8)]
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def legacy_merges(path: pathlib.Path, out: pathlib.Path):
    j = json.loads(path.read_text(encoding="utf-8"))
    j["model"]["merges"] = [f"{a} {b}" for a, b in j["model"]["merges"]]
    out.write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")


def with_prefix_space(path: pathlib.Path, out: pathlib.Path):
    j = json.loads(path.read_text(encoding="utf-8"))
    j["pre_tokenizer"]["add_prefix_space"] = True
    out.write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer_files(documents, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    files = {}
    for name, train in (("gpt2", train_gpt2), ("llama3", train_llama3)):
        path = d / f"{name}.json"
        train(documents).save(str(path))
        files[name] = path
        legacy_merges(path, d / f"{name}-legacy.json")
        files[f"{name}-legacy"] = d / f"{name}-legacy.json"
    with_prefix_space(files["gpt2"], d / "gpt2-prefix.json")
    files["gpt2-prefix"] = d / "gpt2-prefix.json"
    return files


# --- the inputs: text (str) or raw bytes (bytes, compared as tokenizers sees them after decoding) ---

WHITESPACE = ([chr(c) for c in range(0x09, 0x0E)] + [chr(c) for c in range(0x1C, 0x21)] +
              ["\x85", "\xa0", "\u1680", "\u180e", "\u200b", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
               "\ufeff"] + [chr(c) for c in range(0x2000, 0x200B)])


def real_paragraphs(documents, n=300):
    paras = [p for d in documents for p in d.split("\n\n") if p.strip()]
    step = max(1, len(paras) // n)
    return paras[::step][:n] + documents[::max(1, len(documents) // 20)][:20]


def category_samples():
    """A few code points of every general category (Cs excluded: Python str, not UTF-8), in contexts."""
    by_cat = {}
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        by_cat.setdefault(unicodedata.category(chr(c)), []).append(c)
    out = []
    for cat, cps in sorted(by_cat.items()):
        picks = [cps[0], cps[len(cps) // 3], cps[len(cps) // 2], cps[-1]]
        for c in map(chr, picks):
            out += [c, f"a{c}b", f" {c}{c}1", f"'{c} {c}\n", f"1{c}2 x{c}'s", f"{c}   {c}"]
    return out


def sweep(step, lo=0, hi=0x110000, chunk=256):
    """Code points lo..hi every `step` (surrogates skipped), each beside a letter, a digit, a space and a
    contraction: \\s, \\p{L} and \\p{N} decide how these split."""
    cps = [c for c in range(lo, hi, step) if not 0xD800 <= c <= 0xDFFF]
    out = []
    for i in range(0, len(cps), chunk):
        out.append("".join(f"{chr(c)}a{chr(c)}1 {chr(c)}{chr(c)}\n{chr(c)}'s x{chr(c)}'S"
                           for c in cps[i:i + chunk]))
        out.append("".join(chr(c) for c in cps[i:i + chunk]))
    return out


def adversarial():
    cases = [
        "", " ", "a", "\n", "Hello, world!", "hello world", "hello worldly", "naïve_added", "xnaïve_addedy",
        "e\u0301", "a\u0300\u0301\u0302\u0303 b", "\u0301 starts with a mark", "Z\u0351\u0358\u0360a\u0362l\u0327go",
        "👨‍👩‍👧‍👦 family", "🏳️‍🌈", "🇺🇸🇫🇷", "👍🏽👍🏿", "a😀b 😀😀 1😀",
        "你好，世界。日本語のテキスト。한국어 텍스트", "中文 123 中文", "ｆｕｌｌ　ｗｉｄｔｈ　１２３",
        "مرحبا بالعالم", "שלום עולם", "عدد ١٢٣٤٥ و 678", "\u202eright-to-left override\u202c",
        "a\r\nb", "\r\n\r\n", " \n \n", "\t\t\n  \r", "a\n\n\nb  \n c", "line\r\rline", "a \t b\t\t c",
        "  leading", "trailing  ", "  both  ", "x\n y\n\n  z", "\n\n\n", "  \n\n  ",
        "DON'T", "don't", "it’s", "It'S", "we'LL", "I'M", "they'RE", "you'VE", "he'D", "'s'S'ſ", "'K'k",
        "'ll've're", "O'Neil's", "''s", "' s", "ſ's", "I'Mﬆ", "'\u017f'\u212a", "ﬀﬁﬂ 'ﬆ",
        "a<|endoftext|>b", "<|endoftext|>", "<|endoftext|><|endoftext|>", " <|endoftext|> ", "<|endoftext",
        "<|endoftext|>hello world<|endoftext|>", "<|begin_of_text|>Hello<|end_of_text|>",
        "x<|reserved_special_token_3|>y", "<|reserved_special_token_7|><|reserved_special_token_8|>",
        "<|end_of_text|> <|end_of_text|>\n", "<<|endoftext|>>", "<|<|endoftext|>|>",
        "1234567890", "3.14159 2,718 1e10 0x1F 1_000_000", "٣٤٥ ௧௨௩ ⅣⅫ ½¾ ²³",
        "#!/usr/bin/env python\nimport os\n\ndef f(x):\n    return x ** 2  # square\n",
        "<html><body class=\"x\">&amp;&#x27;</body></html>", "$$\\frac{a}{b}$$", "a--b...c!!!???",
        "\x00\x01\x02 control \x7f\x1b[0m",
    ]
    for w in WHITESPACE:
        cases += [w, f"a{w}b", f"a{w}{w} b", f"a {w}", f"{w}\n", f"x{w}'s", f"1{w}2", f"{w}{w}{w}x", f" {w}a"]
    long = 10000
    cases += [" " * long, "\n" * long, "1" * long, "a" * long, " " * long + "a", "a" + " " * long + "b",
              "\t" * long, "\r\n" * (long // 2), "1 " * (long // 2), "12345" * (long // 5), "ab" * (long // 2),
              "\u3000" * long, "\x85" * long, "😀" * 3000, "'s" * 5000]
    cases += category_samples()
    cases += sweep(97)
    rng = random.Random(5)
    pool = list("aZé ß1٣ \t\n\r'’\",.!?-_") + ["  ", "\r\n", "中", "😀", "\u0301", "\xa0", "\x85", "\u2028", "ſ",
                                               "<|endoftext|>", "<|end_of_text|>", "hello world", "'S", "'ll"]
    cases += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(400)]
    return cases


def invalid_utf8():
    cases = [b"\x80", b"a\x80b", b"\xbf\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xed\xa0\x80",
             b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5", b"\xf8\x88\x80\x80\x80", b"\xff\xfe", b"\xe2\x82",
             b"\xe2\x82a", b"\xf0\x9f\x98", b"\xf0\x9f", b"abc\xf0", b"\xc3", b"\xc3\xa9\xc3", b"\xe2\x28\xa1",
             b"\xf0\x28\x8c\xbc", b"a<|endoftext|\xff>", b"<|endoftext|>\x80", b" \x80 \x80\x80 ", b"\xe0\xa0",
             b"\xf1\x80\x80", b"\xef\xbf\xbd\xef\xbf", b"x\xed\x9f\xbfy"]
    rng = random.Random(7)
    cases += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 60))) for _ in range(100)]
    cases += [bytes(rng.choice(b"a \n\x80\xbf\xc2\xe0\xed\xf0\xf4\xa0\x9f") for _ in range(rng.randint(1, 30)))
              for _ in range(100)]
    return cases


# --- running both sides ---

def run_depthkit(program, tokenizer, inputs, special, tmp_path):
    path = tmp_path / "inputs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for x in inputs:
            line = {"b64": base64.b64encode(x).decode()} if isinstance(x, bytes) else x
            f.write(json.dumps(line, ensure_ascii=True) + "\n")
    cmd = [program, "data", "encode", "--tokenizer", str(tokenizer), "--input", str(path), "--decode"]
    if special:
        cmd.append("--special")
    r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, f"{' '.join(cmd)} failed: {r.stderr}"
    out = [json.loads(line) for line in r.stdout.split("\n") if line]
    assert len(out) == len(inputs)
    return out


def as_text(x):
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else x


def short(v, n=160):
    s = repr(v)
    return s if len(s) <= n else s[:n] + f"... ({len(v)} long)"


def compare(program, tokenizer_path, inputs, special, tmp_path, check_decode=True):
    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.encode_special_tokens = not special
    texts = [as_text(x) for x in inputs]
    want = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    got = run_depthkit(program, tokenizer_path, inputs, special, tmp_path)
    bad = []
    for x, w, g in zip(inputs, want, got):
        if g["ids"] != w:
            bad.append(f"  input {short(x)}\n    tokenizers {short(w)}\n    depthkit   {short(g['ids'])}")
        elif check_decode and g["decoded"] != tok.decode(w):
            bad.append(f"  input {short(x)}\n    tokenizers decode {short(tok.decode(w))}\n"
                       f"    depthkit decode   {short(g['decoded'])}")
    if bad:
        print(f"{tokenizer_path.name} ({'--special' if special else 'ordinary'}): {len(bad)} of {len(inputs)} differ",
              file=sys.stderr)
        print("\n".join(bad[:20]), file=sys.stderr)
    assert not bad, f"{len(bad)} of {len(inputs)} inputs differ ({tokenizer_path.name}); see stderr"
    return len(inputs)


VARIANTS = ["gpt2", "gpt2-legacy", "gpt2-prefix", "llama3", "llama3-legacy"]


@pytest.mark.parametrize("special", [False, True], ids=["ordinary", "special"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_equals_tokenizers(variant, special, tokenizer_files, documents, depthkit_program, tmp_path):
    inputs = real_paragraphs(documents) + adversarial() + invalid_utf8()
    compare(depthkit_program, tokenizer_files[variant], inputs, special, tmp_path)


@pytest.mark.parametrize("variant", ["gpt2", "llama3"])
def test_every_code_point_class(variant, tokenizer_files, depthkit_program, tmp_path):
    """Each code point of the BMP and planes 1-2, every 7th above: where \\s, \\p{L} and \\p{N} (PCRE2's
    Unicode tables against Oniguruma's) put it decides the pre-tokens."""
    inputs = sweep(1, 0, 0x30000) + sweep(7, 0x30000, 0x110000)
    compare(depthkit_program, tokenizer_files[variant], inputs, False, tmp_path, check_decode=False)


@pytest.mark.parametrize("variant", ["gpt2", "llama3"])
def test_whole_bundled_corpus(variant, tokenizer_files, documents, depthkit_program, tmp_path):
    """Every document of the bundled corpus (497, 11 MB), whole, as data prepare encodes them."""
    compare(depthkit_program, tokenizer_files[variant], documents, False, tmp_path)
