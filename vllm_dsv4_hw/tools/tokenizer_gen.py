# SPDX-License-Identifier: Apache-2.0
"""An offline tokenizer for the generated checkpoints: byte-level BPE trained on built-in text.

No tokenizer can be downloaded here, so the checkpoint generator trains one with the ``tokenizers``
library on the small text below (written for this purpose). Byte-level BPE encodes any string and
decodes it back exactly. The vocabulary has exactly ``vocab_size`` entries, laid out as:

* ids 0..6: the DeepSeek-style special tokens (BOS, EOS, pad, the User / Assistant role markers,
  and ``<think>`` / ``</think>``; the last two are ordinary, visible added tokens);
* then the 256 byte symbols and the learned merges (at most ``MAX_BPE_TOKENS`` tokens in all: the
  built-in text yields a little more);
* for a larger vocabulary (the real models' 129,280), unused filler tokens ``<unused_N>`` up to the
  placeholders: plain vocabulary entries that no merge produces (text never encodes to them; they
  decode to their name), so the vocabulary has the real size with a fast, small tokenizer;
* the last ``N_PLACEHOLDERS`` ids: reserved special tokens ``<｜place▁holder▁no▁N｜>`` (as DeepSeek's
  own tokenizer reserves), so the layout does not depend on how many merges the text yields.

A ``TemplateProcessing`` post-processor prepends BOS (``add_bos_token``), as DeepSeek's tokenizers
do; the chat template also starts with ``bos_token`` and is applied without special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, THINK, END_THINK)
VISIBLE_ADDED = (THINK, END_THINK)  # added tokens that decode as text
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
N_PLACEHOLDERS = 8
MAX_BPE_TOKENS = 2048  # special tokens + bytes + merges (the built-in text yields 2310)

# System messages first, then the turns; an assistant turn ends with EOS; the generation prompt
# is the Assistant marker. (DeepSeek's role markers; "thinking" mode is left to the caller.)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
)

# Training text: varied English prose, numbers, a little code and non-ASCII, so that the merges
# look like a real tokenizer's (whole common words, digit groups, indentation).
CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
A long context model reads a whole book before it answers a single question about chapter three.
Attention lets every token look back at the tokens before it; compression lets it look much farther.
In the morning the market opened early, and traders watched the prices of copper, wheat and oil.
She walked along the river until the city lights faded behind the hills and the stars came out.
Good software is written twice: once to learn what the problem is, and once to solve it well.
The library closes at nine on weekdays and at five on Saturday; it is closed on public holidays.
Rain fell all night on the tin roof, and by dawn the garden paths had turned into small streams.
Mathematics is the art of giving the same name to different things, a famous author once wrote.
If the cache is full, the scheduler preempts the newest request and frees its blocks for others.
Our team measured the latency of every request, the throughput of the server, and its memory use.
The museum keeps old maps, letters, coins and tools from the villages that once stood by the coast.
When you travel by train you can read, sleep, look out of the window or talk with other passengers.
Please send the report before Friday, including the tables, the figures and a short summary.
Children learn languages quickly because they are not afraid of making mistakes in front of others.
The recipe needs two cups of flour, one egg, half a cup of milk, a pinch of salt and some butter.
Scientists observed the comet for three weeks and computed its orbit around the sun very precisely.
History teaches us that great changes often begin with small ideas shared among a few friends.
Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on high mountains.
The orchestra played a symphony by a composer who had written it in a small house near the lake.
Every evening the old fisherman repaired his nets and told stories about storms he had survived.
Modern processors run many threads at once, yet memory bandwidth still limits most workloads.
Farmers plant seeds in spring, water them through the summer, and harvest the crops in autumn.
He opened the door slowly, listened for a moment, and then stepped into the dark empty hallway.
The committee will meet again next month to discuss the budget, the schedule and the new rules.
Birds migrate thousands of kilometers each year, guided by the sun, the stars and the magnetic field.
A good question is often more valuable than a quick answer, especially when the data are noisy.
The bridge was built in 1932, repaired in 1978, and finally replaced by a wider one in 2015.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024 appear often.
Prices rose by 3.5 percent in March, fell by 1.25 percent in April, and stayed flat until July.
The meeting starts at 10:30 and ends at 12:00; lunch is served at 12:15 in the second-floor hall.
Call 555-0100 or write to the office at 42 Market Street, Springfield, before the 31st of May.
Version 2.4.1 fixed a crash on start-up; version 2.5.0 added support for larger input files.
The temperature dropped from 21 degrees at noon to 7 degrees at midnight, with strong wind.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

if __name__ == "__main__":
    counter = Counter()
    while counter.increment() < 5:
        pass
import json, os, sys
data = {"name": "example", "values": [1, 2, 3], "enabled": true, "ratio": 0.75}
print(json.dumps(data, indent=2))
SELECT name, price FROM products WHERE price > 100 ORDER BY price DESC LIMIT 10;
<html><body><p>Hello, world!</p><a href="https://example.com/page?id=7">link</a></body></html>
The café on the corner serves crème brûlée, naïve tourists order it twice, and nobody complains.
Zürich, São Paulo, Kraków, Málaga and Reykjavík are cities with letters beyond plain ASCII.
Greek letters like alpha α, beta β, gamma γ, delta δ, lambda λ, pi π and sigma σ appear in formulas.
人工智能 语言 模型 长 上下文 注意力 压缩 稀疏 缓存 推理 服务 你好 世界 谢谢 再见
日本語 の 文章 も 少し 入れて おきます。 こんにちは、 世界。 ありがとう ございます。
Emoji and symbols also show up in real text: ✓ ✗ → ← ★ ☆ © ® ™ € £ ¥ ° ± × ÷ ≤ ≥ ≠ ∞.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
Question: Who wrote the play about a prince of Denmark? Answer: It was written by Shakespeare.
User: Can you explain what a transformer model is? Assistant: It is a neural network built from
layers of attention and feed-forward blocks, trained to predict the next token in a sequence.
User: Summarize the text in one sentence. Assistant: The text describes a quiet village by the sea.
User: Translate "good morning" into Spanish. Assistant: "Good morning" is "buenos días" in Spanish.
Mountains, rivers, forests, deserts, islands, valleys, lakes, oceans, glaciers and volcanoes.
Red, orange, yellow, green, blue, indigo, violet, black, white, gray, brown, pink and purple.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January, February, March, April,
May, June, July, August, September, October, November and December.
Doctors, teachers, engineers, artists, farmers, pilots, nurses, lawyers, writers and musicians.
Apples, bananas, cherries, grapes, lemons, mangoes, oranges, peaches, pears and strawberries.
Running, swimming, cycling, climbing, skiing, rowing, dancing, singing, reading and painting.
The experiment failed three times before the researchers noticed a loose cable under the table.
Although the road was long and the weather was bad, the travelers arrived safely before dark.
Because the file was too large to send by email, they uploaded it to a shared folder instead.
The small robot rolled across the floor, stopped near the wall, and turned its camera to the left.
Economists argue about inflation, interest rates, employment, trade, taxes and public spending.
The novel follows two sisters who inherit a bookshop and try to keep it open for one more year.
Students should read the instructions carefully, answer every question, and check their work.
The engine makes a strange noise when it is cold, but it runs smoothly after a few minutes.
Light travels about three hundred thousand kilometers per second through empty space.
Her grandfather kept bees behind the barn and sold honey at the market every Sunday morning.
The network connection dropped twice during the call, so they agreed to continue by message.
A compiler translates source code into machine instructions; an interpreter runs it directly.
Sparse attention selects a few important blocks, while dense attention looks at every position.
The indexer scores compressed entries, keeps the top ones, and the attention reads only those.
Each layer mixes its streams through hyper connections before and after attention and experts.
Mixture of experts models route every token to a few specialists chosen by a learned gate.
Quantized weights use fewer bits per value, which saves memory and often speeds up inference.
The weather forecast for tomorrow says sunny skies in the morning and light rain after lunch.
They planted an oak tree in the park to remember the day the new school finally opened.
The detective studied the footprints, the broken window and the open drawer, and then smiled.
Learning to play the piano takes patience, practice, and a teacher who knows when to push.
The spacecraft sent back pictures of a red desert, tall cliffs and a sky full of thin clouds.
Volunteers cleaned the beach on Saturday and collected more than two hundred bags of plastic.
The contract must be signed by both parties and returned within fourteen days of receipt.
Our neighbors adopted a puppy that barks at the mail carrier but loves everyone else.
Good documentation explains why the code exists, not only what each function does.
The old clock in the tower strikes every hour, and the pigeons fly up each time it rings.
"""


def _bpe_vocab_target(vocab_size: int) -> int:
    return min(vocab_size - N_PLACEHOLDERS, MAX_BPE_TOKENS)


def placeholder_token(i: int) -> str:
    return f"<｜place▁holder▁no▁{i}｜>"


def filler_token(i: int) -> str:
    return f"<unused_{i}>"


def build_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    target = _bpe_vocab_target(vocab_size)
    if target < len(SPECIAL_TOKENS) + 256 + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE tokenizer "
            f"(need at least {len(SPECIAL_TOKENS) + 257 + N_PLACEHOLDERS})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the lines a few times so that frequent words win the merges over one-off fragments.
    lines = CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines * 3, trainer=trainer)
    learned = tok.get_vocab_size()
    if learned != target:
        raise RuntimeError(
            f"the built-in text yields {learned} BPE tokens, not the {target} that "
            f"vocab_size {vocab_size} needs; use a smaller vocab_size"
        )
    n_fill = vocab_size - N_PLACEHOLDERS - target
    if n_fill:
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for i in range(n_fill):
            vocab[filler_token(i)] = target + i
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(
        [
            AddedToken(placeholder_token(i), special=True, normalized=False)
            for i in range(N_PLACEHOLDERS)
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    # <think> / </think> are added tokens that stay visible in decoded text.
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in VISIBLE_ADDED:
            entry["special"] = False
    for name, want in ((BOS, BOS_ID), (EOS, EOS_ID), (PAD, PAD_ID)):
        got = tok.token_to_id(name)
        if got != want:
            raise RuntimeError(f"special token {name} got id {got}, expected {want}")
    return Tokenizer.from_str(json.dumps(spec))


def special_token_ids(vocab_size: int) -> list[int]:
    """Ids of the special and reserved (non-text) tokens: BOS, EOS, pad, role markers, unused
    fillers, placeholders."""
    fixed = [i for i, t in enumerate(SPECIAL_TOKENS) if t not in VISIBLE_ADDED]
    return fixed + list(range(_bpe_vocab_target(vocab_size), vocab_size))


def tokenizer_config(model_max_length: int) -> dict:
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t not in VISIBLE_ADDED,
        }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the names."""
    out = Path(out_dir)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2, ensure_ascii=False
        )
        + "\n"
    )
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
