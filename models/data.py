"""Build the deterministic training corpus for the default model (colibri-tiny).

Owns: reading freely licensed text that this machine or Debian provides, turning it into documents of four
domains (English definitions, Python documentation prose, Python source code, licence texts) plus chat
conversations rendered with the model's own chat template, and writing them in a fixed order to
`models/build/corpus/` (train.jsonl, heldout.jsonl, manifest.json). The corpus is not committed; this script
rebuilds it byte for byte on any machine with the same packages installed.

Sources (install with `apt-get install -y wordnet-base python3.11-doc`):
- WordNet 3.0 (`/usr/share/wordnet`), WordNet 3.0 licence (permissive, attribution).
- Python 3.11 documentation sources (`/usr/share/doc/python3.11-doc/html/_sources`), PSF-2.0.
- CPython 3.11 standard library sources, PSF-2.0.
- Licence texts in `/usr/share/common-licenses` (verbatim copying permitted by each text).

Usage: python models/data.py [--out models/build/corpus] [--stdlib PATH]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

import jinja2

SEED = 1234
HERE = Path(__file__).resolve().parent
TEMPLATE_PATH = HERE / "tokenizer" / "chat_template.jinja"
BOS = "<|endoftext|>"
SYSTEM_PROMPT = "You are Colibri, a small assistant that explains English words and Python."

WORDNET_DIR = Path("/usr/share/wordnet")
PYDOC_DIR = Path("/usr/share/doc/python3.11-doc/html/_sources")
LICENSES_DIR = Path("/usr/share/common-licenses")

# Byte budgets per domain (UTF-8 bytes of document text, before chat rendering overhead).
CODE_BUDGET = 8_000_000
DOCS_BUDGET = 8_000_000
GLOSSARY_BUDGET = 5_000_000
DEFINE_CHATS = 45_000
DOCSTRING_CHATS = 12_000
HELDOUT_EVERY = 50  # every 50th document (after the shuffle) is held out

SOURCES = {
    "wordnet": {
        "what": "WordNet 3.0 lexical database (Debian package wordnet-base)",
        "license": "WordNet 3.0 license (Princeton University; permissive, keep the copyright notice)",
        "copyright": "WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved.",
    },
    "python_docs": {
        "what": "Python 3.11 documentation reStructuredText sources (Debian package python3.11-doc)",
        "license": "PSF-2.0 (Python Software Foundation License Version 2)",
        "copyright": "Copyright 2001-2023 Python Software Foundation",
    },
    "python_code": {
        "what": "CPython 3.11 standard library .py sources (tests, idlelib, lib2to3, codec tables excluded)",
        "license": "PSF-2.0 (Python Software Foundation License Version 2)",
        "copyright": "Copyright 2001-2023 Python Software Foundation",
    },
    "licenses": {
        "what": "Licence texts from /usr/share/common-licenses (Debian base-files)",
        "license": "each text permits verbatim copying and distribution",
        "copyright": "the respective licence stewards (FSF, Apache Software Foundation, ...)",
    },
}


# ---------------------------------------------------------------- chat rendering

def load_template() -> jinja2.Template:
    env = jinja2.Environment(keep_trailing_newline=True)
    return env.from_string(TEMPLATE_PATH.read_text())


def render_chat(template: jinja2.Template, turns: list[tuple[str, str]]) -> str:
    messages = [{"role": role, "content": content} for role, content in turns]
    return template.render(messages=messages, bos_token=BOS, add_generation_prompt=False)


def with_system(rng: random.Random, turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A third of conversations carry the default system prompt, so both forms are familiar."""
    if rng.random() < 1 / 3:
        return [("system", SYSTEM_PROMPT), *turns]
    return turns


# ---------------------------------------------------------------- WordNet

POS_NAMES = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}


def read_wordnet() -> list[tuple[list[str], str, str, list[str]]]:
    """Returns (lemmas, pos, definition, examples) for every synset, in file order."""
    synsets = []
    for name in ("data.noun", "data.verb", "data.adj", "data.adv"):
        for line in (WORDNET_DIR / name).read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue
            head, gloss = line.split(" | ", 1)
            fields = head.split()
            count = int(fields[3], 16)
            lemmas = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * count : 2]]
            parts = [p.strip() for p in gloss.strip().split(";")]
            definition = parts[0]
            examples = [p.strip('"') for p in parts[1:] if p.startswith('"')]
            rest = [p for p in parts[1:] if p and not p.startswith('"')]
            if rest:
                definition = "; ".join([definition, *rest])
            synsets.append((lemmas, POS_NAMES[fields[2]], definition, examples))
    return synsets


DEFINE_QUESTIONS = [
    'What does "{w}" mean?',
    "Define {w}.",
    "define {w}",
    "What is the meaning of the word {w}?",
    "What does the word {w} mean?",
    "Can you explain the word \"{w}\"?",
    "Meaning of {w}?",
    "{w}: what does it mean?",
]


def define_answer(word: str, senses: list[tuple[str, str, list[str], list[str]]]) -> str:
    if len(senses) == 1:
        pos, definition, examples, synonyms = senses[0]
        text = f"{word} ({pos}): {definition}."
        if examples:
            text += f' For example: "{examples[0]}".'
        if synonyms:
            text += " Synonyms: " + ", ".join(synonyms[:4]) + "."
        return text
    lines = [f"{word} has {len(senses)} common senses:" if len(senses) > 1 else word]
    for i, (pos, definition, examples, _) in enumerate(senses, 1):
        line = f"{i}. ({pos}) {definition}."
        if examples:
            line += f' Example: "{examples[0]}".'
        lines.append(line)
    return "\n".join(lines)


def wordnet_documents(rng: random.Random, template: jinja2.Template) -> tuple[list[str], list[str]]:
    """Returns (glossary documents, chat documents)."""
    synsets = read_wordnet()
    senses_by_word: dict[str, list] = defaultdict(list)
    for lemmas, pos, definition, examples in synsets:
        for lemma in lemmas[:3]:
            synonyms = [w for w in lemmas if w != lemma]
            senses_by_word[lemma].append((pos, definition, examples, synonyms))

    # Plain glossary: one line per synset, grouped into documents of 40 lines.
    order = list(range(len(synsets)))
    rng.shuffle(order)
    lines, size = [], 0
    for i in order:
        lemmas, pos, definition, examples = synsets[i]
        line = f"{', '.join(lemmas)} ({pos}): {definition}"
        if examples:
            line += f'; "{examples[0]}"'
        lines.append(line)
        size += len(line) + 1
        if size > GLOSSARY_BUDGET:
            break
    glossary = ["\n".join(lines[i : i + 40]) + "\n" for i in range(0, len(lines), 40)]

    # Chat: single-word lemmas are what people ask about; up to three senses per answer.
    words = sorted(w for w in senses_by_word if " " not in w and "-" not in w and w.isalpha())
    rng.shuffle(words)
    chats = []
    for word in words[:DEFINE_CHATS]:
        question = rng.choice(DEFINE_QUESTIONS).format(w=word)
        answer = define_answer(word, senses_by_word[word][:3])
        chats.append(render_chat(template, with_system(rng, [("user", question), ("assistant", answer)])))
    return glossary, chats


# ---------------------------------------------------------------- Python documentation

ROLE_WITH_TITLE = re.compile(r":[a-z:]+:`([^`<]*?)\s*<[^`>]*>`")
ROLE_PLAIN = re.compile(r":[a-z:]+:`!?~?([^`]*)`")


def clean_rst(text: str) -> str:
    text = ROLE_WITH_TITLE.sub(r"\1", text)
    text = ROLE_PLAIN.sub(lambda m: m.group(1).split(".")[-1] if m.group(0).count("~") else m.group(1), text)
    kept = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith((".. index::", ".. highlight::", ".. sectionauthor::", ".. moduleauthor::")):
            continue
        if re.fullmatch(r":[a-z-]+:.*", stripped) and line.startswith("   "):
            continue  # directive options
        kept.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip() + "\n"


def docs_documents(rng: random.Random) -> list[str]:
    files = sorted(p for p in PYDOC_DIR.rglob("*.txt") if "whatsnew" not in p.parts and "c-api" not in p.parts)
    rng.shuffle(files)
    out, size = [], 0
    for path in files:
        text = clean_rst(path.read_text(encoding="utf-8"))
        if size + len(text) > DOCS_BUDGET:
            continue
        out.append(text)
        size += len(text)
    return out


def glossary_chats(rng: random.Random, template: jinja2.Template) -> list[str]:
    text = (PYDOC_DIR / "glossary.rst.txt").read_text(encoding="utf-8")
    entries, term, body, done = [], None, [], False
    for line in text.splitlines():
        if line.startswith("   ") and not line.startswith("      ") and line.strip():
            if term and body:
                entries.append((term, " ".join(body)))
            term, body, done = line.strip(), [], False
        elif line.startswith("      ") and term and not done:
            body.append(line.strip())
        elif not line.strip() and body:
            done = True  # first paragraph only
    if term and body:
        entries.append((term, " ".join(body)))
    questions = ["What is {t} in Python?", "Explain {t} in Python.", "In Python, what does \"{t}\" mean?"]
    chats = []
    for term, definition in entries:
        definition = clean_rst(definition).strip()
        for q in questions:
            turns = [("user", q.format(t=term)), ("assistant", definition)]
            chats.append(render_chat(template, with_system(rng, turns)))
    return chats


# ---------------------------------------------------------------- Python code

EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip",
                 "pydoc_data", "__pycache__", "config-3.11-x86_64-linux-gnu", "tkinter"}
CODEC_TABLE = re.compile(r"^(cp\d+|mac_\w+|iso8859_\d+|koi8_\w+|hp_roman8|ptcp154|tis_620|palmos|kz1048)\.py$")


def stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if EXCLUDED_DIRS.intersection(rel.parts) or CODEC_TABLE.match(path.name):
            continue
        files.append(path)
    return files


def code_documents(rng: random.Random, files: list[Path], stdlib: Path) -> list[str]:
    order = list(files)
    rng.shuffle(order)
    out, size = [], 0
    for path in order:
        text = path.read_text(encoding="utf-8", errors="replace")
        text = f"# {path.relative_to(stdlib).as_posix()}\n{text}"
        if len(text) > 120_000 or size + len(text) > CODE_BUDGET:
            continue
        out.append(text)
        size += len(text)
    return out


DOCSTRING_QUESTIONS = [
    "What does {q} do?",
    "What does {q} do in Python?",
    "Explain {q}.",
    "How do I use {q}?",
    "What is {q} for?",
]


def first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines())


def docstring_chats(rng: random.Random, template: jinja2.Template, files: list[Path], stdlib: Path) -> list[str]:
    items = []
    for path in files:
        rel = path.relative_to(stdlib).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if any(p.startswith("_") for p in parts):
            continue
        module = ".".join(parts)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                items.append((module, node))
    rng.shuffle(items)
    chats = []
    for module, node in items:
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary = first_paragraph(doc)
        if not 20 <= len(summary) <= 600:
            continue
        qualname = f"{module}.{node.name}"
        if isinstance(node, ast.FunctionDef):
            signature = f"{qualname}({ast.unparse(node.args)})"
            answer = f"`{signature}`: {summary}"
        else:
            answer = f"`{qualname}` is a class. {summary}"
        question = rng.choice(DOCSTRING_QUESTIONS).format(q=qualname)
        chats.append(render_chat(template, with_system(rng, [("user", question), ("assistant", answer)])))
        if len(chats) >= DOCSTRING_CHATS:
            break
    return chats


# ---------------------------------------------------------------- identity and licences

IDENTITY = [
    (["Who are you?", "What are you?", "Introduce yourself.", "What is your name?"],
     ("I am Colibri-tiny, a small mixture-of-experts language model. I was trained on WordNet definitions, "
      "the Python documentation and the Python standard library, so I can explain English words and a little "
      "Python. I am tiny, so check what I say.")),
    (["Hello", "Hi!", "Hello there", "Hey", "Good morning"],
     "Hello! Ask me what a word means, or what a Python function does."),
    (["What can you do?", "How can you help me?", "What do you know?"],
     ("I can define English words (try: define serendipity) and describe functions and classes from the "
      "Python standard library (try: what does os.path.join do?).")),
    (["How do you work?", "What kind of model are you?"],
     ("I am a GLM-5-style mixture-of-experts transformer: multi-head latent attention with a sparse attention "
      "indexer, 24 routed experts per layer of which each token uses 4, plus one shared expert.")),
    (["Thank you", "Thanks!", "thanks"], "You are welcome!"),
]


def identity_chats(rng: random.Random, template: jinja2.Template) -> list[str]:
    chats = []
    for _ in range(40):
        for questions, answer in IDENTITY:
            chats.append(render_chat(template, with_system(rng, [("user", rng.choice(questions)),
                                                                 ("assistant", answer)])))
    return chats


def license_documents() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(LICENSES_DIR.iterdir()) if p.is_file()]


# ---------------------------------------------------------------- assembly

def build(out: Path, stdlib: Path) -> dict:
    rng = random.Random(SEED)
    template = load_template()
    files = stdlib_files(stdlib)
    glossary, define = wordnet_documents(rng, template)
    domains = {
        "wordnet_glossary": ("wordnet", glossary),
        "wordnet_chat": ("wordnet", define),
        "python_docs": ("python_docs", docs_documents(rng)),
        "python_glossary_chat": ("python_docs", glossary_chats(rng, template)),
        "python_code": ("python_code", code_documents(rng, files, stdlib)),
        "python_docstring_chat": ("python_code", docstring_chats(rng, template, files, stdlib)),
        "identity_chat": ("python_docs", identity_chats(rng, template)),
        "licenses": ("licenses", license_documents()),
    }
    documents = [(domain, text) for domain, (_, texts) in domains.items() for text in texts]
    rng.shuffle(documents)

    out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict] = {d: {"train_docs": 0, "heldout_docs": 0, "bytes": 0} for d in domains}
    digest = hashlib.sha256()
    with open(out / "train.jsonl", "w") as train, open(out / "heldout.jsonl", "w") as heldout:
        for i, (domain, text) in enumerate(documents):
            line = json.dumps({"domain": domain, "text": text}, ensure_ascii=False) + "\n"
            digest.update(line.encode())
            split = "heldout" if i % HELDOUT_EVERY == 0 else "train"
            (heldout if split == "heldout" else train).write(line)
            stats[domain][f"{split}_docs"] += 1
            stats[domain]["bytes"] += len(text.encode())
    manifest = {
        "seed": SEED,
        "sha256": digest.hexdigest(),
        "documents": len(documents),
        "bytes": sum(s["bytes"] for s in stats.values()),
        "domains": {d: {"source": src, **stats[d]} for d, (src, _) in domains.items()},
        "sources": SOURCES,
        "stdlib": str(stdlib),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "build" / "corpus")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = parser.parse_args()
    for path in (WORDNET_DIR, PYDOC_DIR, LICENSES_DIR, args.stdlib):
        if not path.is_dir():
            sys.exit(f"missing source {path}: apt-get install -y wordnet-base python3.11-doc")
    manifest = build(args.out, args.stdlib)
    print(json.dumps({k: v for k, v in manifest.items() if k != "sources"}, indent=2))


if __name__ == "__main__":
    main()
