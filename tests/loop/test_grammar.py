"""Structured outputs in the loop (specdec.loop.grammar): a grammar per request (JSON schema, regex, EBNF) drives
per-node masks through the draft trees. Every constrained output is valid, greedy speculative output equals
greedy masked autoregressive decoding for every drafter and tree shape, the sampled law is the masked processed
law (with a negative control), the matchers' state follows the output, bad grammars are refused by name."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from specdec.loop.cli import ASSETS, main as cli_main
from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import DraftModelDrafter, Drafter, MTPDrafter, NgramDrafter, Proposal, SuffixDrafter
from specdec.loop.drafters.parallel import ParallelDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.mtp import load_mtp
from specdec.loop.models.tokenizer import EOS, VOCAB_SIZE, ByteTokenizer
from specdec.reference import processed_probs
from specdec._layout import unpack_bitmask

from test_loop import chi_square_two_tokens

xgrammar = pytest.importorskip("xgrammar")
from specdec.loop.grammar import ALL_ALLOWED, TreeMasks, XGrammarBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = ByteTokenizer()
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
NESTED = {"type": "object", "properties": {"point": {"type": "object", "properties": {
    "x": {"type": "number", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x", "y"]}, "ok": {"type": "boolean"}}, "required": ["point", "ok"]}
ENUMS = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "integer", "minimum": 1, "maximum": 99}},
         "required": ["color", "size"]}
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["id"]}}},
    "required": ["items"]}
SCHEMAS = {"person": PERSON, "nested": NESTED, "enums": ENUMS, "items": ITEMS}
PROMPTS = [TOK.encode(p) for p in ("import json\nx = ", "data = ", "def f():\n    return ", "# config\n")]


@pytest.fixture(scope="module")
def shipped():
    return load_model(os.path.join(ASSETS, "target")), load_model(os.path.join(ASSETS, "draft"))


@pytest.fixture(scope="module")
def backend():
    return XGrammarBackend.byte_vocabulary(VOCAB_SIZE, EOS)


def judge(backend, spec, tokens) -> bool:
    """A fresh matcher of spec takes the output and then the EOS (so the output is complete)."""
    m = backend.matchers(spec, 1)[0]
    return all(m.accept(t) for t in tokens + [EOS]) and m.is_terminated()


def validates(schema, value) -> bool:
    """A small JSON-schema check of the keywords SCHEMAS use (type, properties, required, enum, min/max, items,
    maxItems, maxLength), independent of xgrammar."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        return isinstance(value, dict) and set(schema["required"]) <= set(value) and set(value) <= \
            set(schema["properties"]) and all(validates(schema["properties"][k], v) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)) and \
            all(validates(schema["items"], v) for v in value)
    if kind in ("integer", "number"):
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, (int, float))
        return ok and not isinstance(value, bool) and schema.get("minimum", value) <= value <= \
            schema.get("maximum", value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


# ----------------------------------------------------------------------------------------------
# every constrained output is valid
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_constrained_outputs_validate(shipped, backend, name):
    """Batch 1 greedy, batch 4 greedy and sampled (T = 0.8, three seed sets) with a free request among three
    constrained ones: every constrained output ends at the EOS and is a JSON document of its schema (13 outputs a
    schema, 52 over the four); the free request is the unconstrained output."""
    target, draft = shipped
    schema = SCHEMAS[name]
    spec = {"json_schema": schema}
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"))
    n = 96
    outputs = decoder.generate(PROMPTS[:1], n, grammar=spec).tokens
    mixed = [spec, None, spec, spec]
    for temperature, seed in ((0.0, 0), (0.8, 10), (0.8, 20), (0.8, 30)):
        out = decoder.generate(PROMPTS, n, temperature, seed, grammar=mixed).tokens
        outputs += [out[0], out[2], out[3]]
        if temperature == 0.0:
            assert out[1] == generate_ar(target, PROMPTS[1:2], n).tokens[0]
    assert len(outputs) == 13
    for tokens in outputs:
        assert len(tokens) < n, TOK.decode(tokens)  # ended at the EOS, not at max_new_tokens
        assert judge(backend, spec, tokens), TOK.decode(tokens)
        assert validates(schema, json.loads(TOK.decode(tokens))), TOK.decode(tokens)


def test_grammar_composes_with_the_sampling_parameters(shipped, backend):
    """A grammar with a repetition penalty, a logit bias, top-k, processed logprobs and a batch padded to its
    bucket: the constrained outputs are valid, and each emitted token's processed logprob is finite (the law it
    was drawn from, the grammar's mask included, allowed it)."""
    target, draft = shipped
    spec = {"json_schema": ENUMS}
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,2,1"), batch_buckets=(4,))
    out = decoder.generate(PROMPTS[:3], 64, 0.8, seed=3, grammar=[spec, None, spec], repetition_penalty=1.3,
                           logit_bias={ord("7"): 2.0}, top_k=20, logprobs=2, logprobs_mode="processed")
    for b in (0, 2):
        assert judge(backend, spec, out.tokens[b]), TOK.decode(out.tokens[b])
    assert all(math.isfinite(x) for lp in out.logprobs for x in lp)


def test_regex_and_ebnf_outputs_match(shipped, backend):
    """A regex and an EBNF grammar, greedy and sampled, speculative with a tree: each output is in the language."""
    target, draft = shipped
    specs = [{"regex": r"(import|from) [a-z]{1,6}( as [a-z]{1,3})?\n"},
             {"ebnf": 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'}]
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,2,1"))
    for temperature in (0.0, 1.0):
        out = decoder.generate(PROMPTS[:2], 64, temperature, seed=3, grammar=specs).tokens
        for spec, tokens in zip(specs, out):
            assert judge(backend, spec, tokens), (spec, TOK.decode(tokens))


def test_the_validity_check_can_fail(backend):
    """The judges reject what they should: a truncated document, a wrong enum value, a number out of range."""
    assert not judge(backend, {"json_schema": ENUMS}, list(b'{"color": "red", "size": 5'))
    assert judge(backend, {"json_schema": ENUMS}, list(b'{"color": "red", "size": 5}'))
    assert not judge(backend, {"json_schema": ENUMS}, list(b'{"color": "pink", "size": 5}'))
    assert not validates(ENUMS, {"color": "pink", "size": 5}) and not validates(ENUMS, {"color": "red", "size": 0})


# ----------------------------------------------------------------------------------------------
# greedy speculative == greedy masked AR by full forwards
# ----------------------------------------------------------------------------------------------
def masked_greedy_ar(target, backend, prompts, specs, n):
    """Greedy decoding sharing nothing with the loop but the grammar engine: at each position the full forward of
    the whole sequence, the argmax over the tokens a fresh matcher fed the output allows; up to the EOS."""
    outs = []
    with torch.no_grad():
        for prompt, spec in zip(prompts, specs):
            m = None if spec is None else backend.matchers(spec, 1)[0]
            seq, out = list(prompt), []
            while len(out) < n:
                row = target(torch.tensor([seq]))[0, -1]
                if m is not None:
                    bits = torch.zeros(1, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
                    m.fill(bits, 0)
                    row = row.masked_fill(~unpack_bitmask(bits[0], VOCAB_SIZE), float("-inf"))
                token = int(row.argmax())
                if token == EOS:
                    break
                assert m is None or m.accept(token)
                seq.append(token)
                out.append(token)
            outs.append(out)
    return outs


GREEDY_SPECS = [{"json_schema": PERSON}, {"regex": r"[a-z_]{2,12}\(\d, \d\)"}, None]


@pytest.fixture(scope="module")
def greedy_expected(shipped, backend):
    return masked_greedy_ar(shipped[0], backend, PROMPTS[:3], GREEDY_SPECS, 48)


@pytest.mark.parametrize("drafter", ["model:chain:4", "model:tree:2,2,1", "model:parents:-1,0,0,1,1,3",
                                     "model:dynamic:7,3,2", "mtp:chain:3", "mtp:dynamic:6,3,2", "ngram", "suffix",
                                     "auto", "none+jump", "ngram+jump", "suffix+jump", "model:chain:4+jump",
                                     "model:dynamic:7,3,2+jump", "mtp:chain:3+jump", "mtp:dynamic:6,3,2+jump",
                                     "parallel:chain:4", "parallel:chain:4+jump"])
def test_greedy_under_a_grammar_equals_masked_ar(shipped, greedy_expected, drafter):
    """For each drafter and tree shape (auto: adaptive depths over chain:8, plain steps included; +jump: with
    jump-forward, forced tokens proposed as chains), a JSON schema, a regex and a free request in one batch: the
    output equals masked greedy AR token for token. The grammar matters: the unconstrained outputs differ."""
    target, draft = shipped
    drafter, jump, _ = drafter.partition("+")
    kind, _, tree = drafter.partition(":")
    if kind == "model":
        d = DraftModelDrafter(draft, tree)
    elif kind == "mtp":
        d = MTPDrafter(target, load_mtp(os.path.join(ASSETS, "mtp"), target.cfg), tree)
    elif kind == "parallel":
        d = ParallelDrafter(load_model(os.path.join(ASSETS, "parallel")), tree)
    elif kind == "ngram":
        d = NgramDrafter(num_tokens=4)
    elif kind == "suffix":
        d = SuffixDrafter(max_depth=4, max_tokens=8)
    elif kind == "auto":
        d = DraftModelDrafter(draft, "chain:8")
    else:
        d = None
    decoder = SpeculativeDecoder(target, d, adaptive=kind == "auto", jump_forward=6 if jump else 0)
    out = decoder.generate(PROMPTS[:3], 48, grammar=GREEDY_SPECS)
    assert out.tokens == greedy_expected
    assert (out.summary["forced_tokens"] > 10) == bool(jump)  # (the schema's keys are forced)
    assert generate_ar(target, PROMPTS[:2], 48).tokens != greedy_expected[:2]


def test_greedy_masked_ar_through_the_loop(shipped, greedy_expected):
    """Plain decoding through the loop (one-node trees) under the grammars equals the full-forward reference too."""
    assert generate_ar(shipped[0], PROMPTS[:3], 48, grammar=GREEDY_SPECS).tokens == greedy_expected


class ForbiddenChains(Drafter):
    """Given proposals that leave the grammar: a chain 'x', 'y', 'z' under the root and a second child '{' (the
    only token a JSON object starts with), so that the walk meets forbidden nodes and a forbidden node's child."""

    max_nodes, max_depth = 5, 3

    def propose(self, tokens, seq_lens, temperature, depth=None):
        B = tokens.shape[0]
        root = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1))
        rest = torch.tensor([ord(c) for c in "xyz{"]).expand(B, 4)
        parents = torch.tensor([-1, 0, 1, 2, 0], dtype=torch.int32).expand(B, 5)
        return Proposal(torch.cat((root, rest), 1), parents, torch.full((B,), 5, dtype=torch.int32))


def test_forbidden_draft_nodes_are_unreachable(shipped, greedy_expected):
    """A drafter proposing forbidden tokens (and children under them): the walk skips their subtrees, the output
    still equals masked greedy AR, and the JSON request's first step accepts the '{' node."""
    target = shipped[0]
    out = SpeculativeDecoder(target, ForbiddenChains()).generate(PROMPTS[:3], 48, grammar=GREEDY_SPECS)
    assert out.tokens == greedy_expected
    assert out.stats[0]["acceptance_by_depth"][0] > 0


def test_tree_masks_walk(backend):
    """TreeMasks on a hand-made tree under the regex a[bc]*d: the root allows 'a' alone; the node 'a' allows b, c,
    d; a forbidden node ('z') and its subtree get all-ones rows (never read: the parent's row forbids 'z'); a node
    after the stop token allows the EOS alone; the matcher is back at the committed output afterwards."""
    m = backend.matchers({"regex": "a[bc]*d"}, 1)[0]
    masks = TreeMasks([m, None], VOCAB_SIZE, [EOS], "cpu")
    masks.begin_step([False, False])
    #          node: 0 root, 1 'a', 2 'z', 3 'b' (under a), 4 'q' (under z), 5 'd' (under a), 6 EOS (under d)
    tokens = torch.tensor([[0, ord("a"), ord("z"), ord("b"), ord("q"), ord("d"), EOS]]).expand(2, -1)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 1, 5]], dtype=torch.int32).expand(2, -1)
    bits = masks.tree_bitmask(tokens, parents, torch.tensor([7, 7]))
    allowed = unpack_bitmask(bits, VOCAB_SIZE)
    assert allowed[0, 0].nonzero().flatten().tolist() == [ord("a")]
    assert allowed[0, 1].nonzero().flatten().tolist() == [ord("b"), ord("c"), ord("d")]
    assert allowed[0, 3].nonzero().flatten().tolist() == [ord("b"), ord("c"), ord("d")]
    assert allowed[0, 5].nonzero().flatten().tolist() == [EOS]
    assert allowed[0, 6].nonzero().flatten().tolist() == [EOS]
    assert (bits[0, 2] == ALL_ALLOWED).all() and (bits[0, 4] == ALL_ALLOWED).all()
    assert (bits[1] == ALL_ALLOWED).all()  # the free request
    fresh = backend.matchers({"regex": "a[bc]*d"}, 1)[0]
    assert m.accept(ord("a")) and not fresh.accept(ord("b"))  # back home: 'a' is the first token again


def test_special_tokens_are_never_text(backend):
    """Inside a JSON string and under a regex's `.`, every byte may come but no special token (BOS, the reserved
    ids): they are not text. The EOS is allowed only where the output may end."""
    m = backend.matchers({"json_schema": {"type": "object", "properties": {"s": {"type": "string"}}}}, 1)[0]
    assert all(m.accept(t) for t in b'{"s": "')
    r = backend.matchers({"regex": ".*"}, 1)[0]
    for matcher in (m, r):
        bits = torch.zeros(1, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
        matcher.fill(bits, 0)
        allowed = unpack_bitmask(bits[0], VOCAB_SIZE)
        assert int(allowed[:256].sum()) > 90 and not allowed[256] and not allowed[258:].any()
        assert bool(allowed[EOS]) == (matcher is r)


# ----------------------------------------------------------------------------------------------
# the sampled law is the masked processed law
# ----------------------------------------------------------------------------------------------
LAW_SPEC = {"regex": r"[a-t][a-z]{1,3}"}  # after "import s": the likely 'y' and 'u' are forbidden first
LAW_PROMPT = TOK.encode("import os\nimport s")


def masked_two_token_law(target, backend, temperature):
    """{(x1, x2): p} of the first two tokens under the processed law masked by the grammar."""
    m = backend.matchers(LAW_SPEC, 1)[0]

    def allowed():
        bits = torch.zeros(1, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
        m.fill(bits, 0)
        return unpack_bitmask(bits[0], VOCAB_SIZE)

    with torch.no_grad():
        p1 = processed_probs(target(torch.tensor([LAW_PROMPT]))[0, -1], temperature, allowed=allowed())
        firsts = p1.nonzero().flatten().tolist()
        rows = target(torch.tensor([LAW_PROMPT + [x] for x in firsts]))[:, -1]
    law = {}
    for i, x1 in enumerate(firsts):
        assert m.accept(x1)
        p2 = processed_probs(rows[i], temperature, allowed=allowed())
        m.rollback(1)
        law.update({(x1, x2): float(p1[x1] * p2[x2]) for x2 in p2.nonzero().flatten().tolist()})
    return law


class MaskBlindDrafter(DraftModelDrafter):
    """Draws its children from the unmasked law while accept is told (draft_logits + token_bitmask) that q is the
    masked law: not lossless."""

    def _grammar_rows(self, tokens, ids, parent_ids):
        return None


@pytest.mark.parametrize("tree", ["chain:3", "tree:2,1", "mtp:chain:2", "dynamic:6,3,2"])
def test_sampled_law_under_a_grammar_is_the_masked_law(shipped, backend, tree):
    """Many seeds in one batch, draft logits (the draft model or MTP samples from its masked law) or given
    proposals (the dynamic tree, ranked under the masks): the first two tokens follow the target's processed law
    under the grammar's masks (chi-square), and never leave its support."""
    target, draft = shipped
    n, temperature = 600, 1.0
    d = MTPDrafter(target, load_mtp(os.path.join(ASSETS, "mtp"), target.cfg), tree[4:]) if tree.startswith("mtp") \
        else DraftModelDrafter(draft, tree)
    out = SpeculativeDecoder(target, d).generate(
        [LAW_PROMPT] * n, 2, temperature, seed=list(range(5000, 5000 + n)), grammar=LAW_SPEC)
    law = masked_two_token_law(target, backend, temperature)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 3
    assert all(tuple(t[:2]) in law for t in out.tokens)
    assert stat < threshold, stat


def test_sampled_law_test_detects_a_mask_blind_drafter(shipped, backend):
    """Negative control: the same run with a drafter that ignores the mask fails the chi-square."""
    target, draft = shipped
    n, temperature = 600, 1.0
    out = SpeculativeDecoder(target, MaskBlindDrafter(draft, "chain:3")).generate(
        [LAW_PROMPT] * n, 2, temperature, seed=list(range(5000, 5000 + n)), grammar=LAW_SPEC)
    stat, threshold, _ = chi_square_two_tokens(out.tokens, masked_two_token_law(target, backend, temperature), n)
    assert stat > threshold


def test_drafters_propose_allowed_tokens_only(shipped, monkeypatch):
    """The draft model drafts under the masks (static and dynamic trees, greedy and sampled): every draft node's
    token is allowed by its parent's row, so no slot goes to a forbidden token, unless its parent has more children
    than allowed tokens (greedy top-2 where the grammar forces one token; a dynamic tree ranks a parent's top-2,
    a forbidden one at -inf, chosen only where fewer allowed candidates remain)."""
    target, draft = shipped
    seen = []
    for tree, width in (("chain:4", None), ("tree:2,2,1", None), ("dynamic:7,3,2", 2)):
        decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, tree))
        verify = decoder._verify

        def checked(s, prop, k):
            bits = s.grammar.tree_bitmask(prop.tokens, prop.parents, prop.num_nodes)
            allowed = unpack_bitmask(bits, VOCAB_SIZE)
            for b in range(prop.tokens.shape[0]):
                parents = prop.parents[b, :int(prop.num_nodes[b])].tolist()
                for i in range(1, len(parents) if s.grammar.live[b] else 0):
                    row = allowed[b, parents[i]]
                    children = width or parents.count(parents[i])
                    seen.append(bool(row[int(prop.tokens[b, i])]) or int(row.sum()) < children)
            verify(s, prop, k)

        monkeypatch.setattr(decoder, "_verify", checked)
        for temperature in (0.0, 1.0):
            decoder.generate(PROMPTS, 40, temperature, grammar={"json_schema": ITEMS})
    assert len(seen) > 100 and all(seen)


def test_jump_forward_adds_tokens_per_step(shipped):
    """Plain decoding with jump-forward under a schema with fixed keys: several tokens a step (every forced token
    is accepted), the forced ones counted, the output that of plain masked decoding."""
    target = shipped[0]
    spec = {"json_schema": PERSON}
    plain = generate_ar(target, PROMPTS[:2], 64, grammar=spec)
    jump = SpeculativeDecoder(target, jump_forward=8).generate(PROMPTS[:2], 64, grammar=spec)
    assert jump.tokens == plain.tokens
    assert plain.summary["tokens_per_step"] == 1.0 and jump.summary["tokens_per_step"] > 1.5
    assert jump.summary["forced_tokens"] >= 20 and plain.summary["forced_tokens"] == 0
    assert jump.summary["acceptance_rate_by_depth"][0] == 1.0


def test_jump_forward_with_the_draft_model(shipped, greedy_expected):
    """The draft model with jump-forward: a request whose grammar forces at least the draft's depth verifies the
    forced chain instead of its tree. The output is masked greedy AR's, more tokens a step than without; with the
    target as its own draft every drafted token is still accepted after such steps (greedy and sampling), so the
    draft's cache caught up on the forced tokens exactly."""
    target, draft = shipped
    specs = GREEDY_SPECS[:2]
    plain = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4")).generate(PROMPTS[:2], 48, grammar=specs)
    jump = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"), jump_forward=16).generate(
        PROMPTS[:2], 48, grammar=specs)
    assert jump.tokens == plain.tokens == greedy_expected[:2]
    assert jump.summary["forced_tokens"] > 10 and jump.summary["tokens_per_step"] > plain.summary["tokens_per_step"]
    for temperature in (0.0, 1.0):
        out = SpeculativeDecoder(target, DraftModelDrafter(target, "chain:3"), jump_forward=16).generate(
            PROMPTS[:2], 48, temperature, seed=5, grammar={"json_schema": PERSON})
        assert out.summary["forced_tokens"] > 10
        assert out.summary["acceptance_rate_by_depth"][:3] == [1.0, 1.0, 1.0]


def test_jump_forward_with_mtp(shipped, greedy_expected):
    """MTP with jump-forward: a forced chain at least the step's depth replaces its tree, and the chain's entries
    come from the target's hidden states of the verified chain, as an accepted path's do. The output is masked
    greedy AR's, more tokens a step than without, and the heads' cache equals a fresh run over the committed
    tokens (a chain longer than MTP's own depth included: jump_forward 16 against chain:3)."""
    from test_mtp import assert_heads_cache_matches_a_fresh_run
    target, _ = shipped
    mtp = load_mtp(os.path.join(ASSETS, "mtp"), target.cfg)
    specs = GREEDY_SPECS[:2]
    plain = SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:3")).generate(PROMPTS[:2], 48, grammar=specs)
    drafter = MTPDrafter(target, mtp, "chain:3")
    jump = SpeculativeDecoder(target, drafter, jump_forward=16).generate(PROMPTS[:2], 48, grammar=specs)
    assert jump.tokens == plain.tokens == greedy_expected[:2]
    assert jump.summary["forced_tokens"] > 10 and jump.summary["tokens_per_step"] > plain.summary["tokens_per_step"]
    assert_heads_cache_matches_a_fresh_run(target, mtp, drafter, "chain:3", PROMPTS[:2], jump.tokens)


JUMP_SPEC = {"regex": r"[a-t]-[a-z]{1,3}"}  # the second token is forced


@pytest.mark.parametrize("drafter", [None, "chain:1", "mtp"])
def test_sampled_law_with_jump_forward(shipped, backend, drafter):
    """Sampling with jump-forward, no drafter, the draft model or MTP (depth 1: a forced token replaces its tree,
    whose draft_logits rows stay): the forced '-' is proposed and accepted, and the free tokens around it, the
    first and the third, follow the masked processed law (chi-square)."""
    target, draft = shipped
    n, temperature = 600, 1.0
    if drafter == "mtp":
        d = MTPDrafter(target, load_mtp(os.path.join(ASSETS, "mtp"), target.cfg), "chain:1")
    else:
        d = None if drafter is None else DraftModelDrafter(draft, drafter)
    out = SpeculativeDecoder(target, d, jump_forward=4).generate(
        [LAW_PROMPT] * n, 3, temperature, seed=list(range(7000, 7000 + n)), grammar=JUMP_SPEC)
    assert all(t[1] == ord("-") for t in out.tokens)
    # (with the draft: where the first step accepted its draft, the '-' came as that step's next token)
    assert out.summary["forced_tokens"] == n if drafter is None else 0 < out.summary["forced_tokens"] < n
    m = backend.matchers(JUMP_SPEC, 1)[0]
    bits = torch.zeros(1, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    with torch.no_grad():
        m.fill(bits, 0)
        p1 = processed_probs(target(torch.tensor([LAW_PROMPT]))[0, -1], temperature,
                             allowed=unpack_bitmask(bits[0], VOCAB_SIZE))
        firsts = p1.nonzero().flatten().tolist()
        rows = target(torch.tensor([LAW_PROMPT + [x, ord("-")] for x in firsts]))[:, -1]
    assert m.accept(firsts[0]) and m.accept(ord("-"))
    m.fill(bits, 0)  # (the third token's mask, [a-z], does not depend on the first)
    allowed3 = unpack_bitmask(bits[0], VOCAB_SIZE)
    law = {}
    for i, x1 in enumerate(firsts):
        p3 = processed_probs(rows[i], temperature, allowed=allowed3)
        law.update({(x1, x3): float(p1[x1] * p3[x3]) for x3 in p3.nonzero().flatten().tolist()})
    stat, threshold, cells = chi_square_two_tokens([[t[0], t[2]] for t in out.tokens], law, n)
    assert len(cells) >= 3
    assert stat < threshold, stat


def test_jump_forward_refusals(shipped):
    """An adaptive loop, another verifier than 'token' or a negative count: jump_forward is refused by name."""
    target, draft = shipped
    for kwargs in (dict(adaptive=True), dict(method="block"), dict(jump_forward=-1)):
        with pytest.raises(ValueError, match="jump_forward"):
            SpeculativeDecoder(target, **{"jump_forward": 4, **kwargs})


# ----------------------------------------------------------------------------------------------
# matcher state, stopping, refusals
# ----------------------------------------------------------------------------------------------
def test_matcher_state_follows_the_output(shipped, backend, monkeypatch):
    """After every step each live constrained request's matcher allows what a fresh matcher fed the output so far
    allows (and is terminated alike), greedy and sampled, with a tree."""
    target, draft = shipped
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,2,1"))
    verify, checks = decoder._verify, []
    specs = [{"json_schema": PERSON}, {"json_schema": NESTED}, None, {"regex": r"[a-z]+(, [a-z]+)*\."}]

    def checked(s, prop, k):
        verify(s, prop, k)
        for b, spec in enumerate(specs):
            if spec is None or not s.grammar.live[b]:
                continue
            output = s.tokens[b, int(s.prompt_lens[b]):int(s.seq_lens[b])].tolist()
            output = output[:output.index(EOS) + 1] if EOS in output else output
            fresh = backend.matchers(spec, 1)[0]
            assert all(fresh.accept(t) for t in output)
            mine = s.grammar.cursors[b].matcher
            assert mine.is_terminated() == fresh.is_terminated()
            if not fresh.is_terminated():
                a, f = (torch.zeros(1, (VOCAB_SIZE + 31) // 32, dtype=torch.int32) for _ in range(2))
                mine.fill(a, 0)
                fresh.fill(f, 0)
                assert torch.equal(a, f)
            checks.append(b)

    monkeypatch.setattr(decoder, "_verify", checked)
    for temperature in (0.0, 0.8):
        decoder.generate(PROMPTS, 60, temperature, seed=7, grammar=specs)
    assert len(checks) > 20


def test_stopping_at_termination_and_max_new_tokens(shipped):
    """A grammar whose language is one string ends its request right after it (the EOS is then the only token
    allowed); max_new_tokens still cuts a longer one."""
    target, draft = shipped
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4")).generate(
        PROMPTS[:2], 20, grammar=[{"regex": "hello"}, {"regex": "x{30}"}])
    assert TOK.decode(out.tokens[0]) == "hello"
    assert TOK.decode(out.tokens[1]) == "x" * 20


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_under_a_grammar(shipped, temperature):
    """min_tokens with a grammar: the stop token is held back while the grammar allows another token (a bias
    toward the EOS would end "a+" after one "a" without it), and allowed when the grammar allows nothing else
    ("ab" is complete after two tokens: the grammar wins, as in vLLM, instead of an empty row). Greedy speculative
    output equals the loop's plain decoding (no drafter) under the same rules; a free request keeps accept's
    min-tokens in the same batch."""
    from specdec.loop.drafters import NoDrafter
    target, draft = shipped
    grammars = [{"regex": "a+"}, {"regex": "ab"}, None]
    args = dict(grammar=grammars, logit_bias={EOS: 12.0}, seed=5)
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:3"))
    free = decoder.generate(PROMPTS[:3], 12, temperature, **args)
    assert TOK.decode(free.tokens[0]) == "a" and TOK.decode(free.tokens[1]) == "ab" and len(free.tokens[2]) < 6
    out = decoder.generate(PROMPTS[:3], 12, temperature, min_tokens=6, **args)
    text = TOK.decode(out.tokens[0])
    assert set(text) == {"a"} and len(text) >= 6, text
    assert TOK.decode(out.tokens[1]) == "ab"
    assert len(out.tokens[2]) >= 6 and EOS not in out.tokens[2][:6]
    if temperature == 0.0:
        plain = SpeculativeDecoder(target, NoDrafter()).generate(PROMPTS[:3], 12, min_tokens=6, **args)
        assert out.tokens == plain.tokens

def test_a_free_batch_passes_no_mask(shipped, monkeypatch):
    """Every request free (grammar None or all None entries): accept gets no token_bitmask; with a constrained
    request it gets one row per node."""
    target, draft = shipped
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"))
    masks, accept = [], decoder._accept

    def spy(logits, prop, **kwargs):
        masks.append(kwargs["token_bitmask"])
        return accept(logits, prop, **kwargs)

    monkeypatch.setattr(decoder, "_accept", spy)
    decoder.generate(PROMPTS[:2], 8)
    decoder.generate(PROMPTS[:2], 8, grammar=[None, None])
    assert masks and all(m is None for m in masks)
    masks.clear()
    decoder.generate(PROMPTS[:2], 8, grammar=[None, {"regex": "[a-z]+"}])
    assert masks and all(m is not None and m.shape == (2, 5, (VOCAB_SIZE + 31) // 32) for m in masks)


@pytest.mark.parametrize("grammar", [
    {"json_schema": "{"}, {"json_schema": {"type": "nonsense"}}, {"regex": "("}, {"ebnf": "root ::= "},
    {"ebnf": "start ::= \"a\""}, {"yaml": "a: 1"}, {"regex": 3}, {"regex": "a", "ebnf": "root ::= \"a\""}, "a+",
    [{"regex": "a"}], [{"regex": "a"}, {"regex": "("}]])
def test_bad_grammars_are_refused_by_name(shipped, grammar):
    """A bad spec, schema, regex or grammar, or a list of the wrong length: ValueError naming `grammar`, raised
    before anything runs (the same decoder then serves the same requests, nothing lost)."""
    target, draft = shipped
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"))
    with pytest.raises(ValueError, match="grammar"):
        decoder.generate(PROMPTS[:2], 8, grammar=grammar)
    again = decoder.generate(PROMPTS[:2], 8, grammar=[{"regex": "[a-z]+"}, None]).tokens
    fresh = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"))
    assert again == fresh.generate(PROMPTS[:2], 8, grammar=[{"regex": "[a-z]+"}, None]).tokens


def test_grammar_needs_eager_steps_and_a_known_vocabulary(shipped):
    """compile=True and CUDA graphs (emulated: a class of CudaStepGraph's interface) refuse grammar by name (their
    steps carry no host walk); so does a target whose vocabulary is not the byte vocabulary, without a
    grammar_backend."""
    target, draft = shipped

    class Replayed:
        def __init__(self, fn, pool):
            fn()

        def replay(self):
            raise AssertionError("a grammar step was replayed")

        @staticmethod
        def new_pool(device):
            return None

    for mode, kwargs in (("compile", dict(compile=True)), ("cuda_graphs", dict(cuda_graphs=Replayed))):
        with pytest.raises(ValueError, match=f"grammar: runs with eager steps only, not with {mode}"):
            SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"), **kwargs).generate(
                PROMPTS[:1], 4, grammar={"regex": "a"})
    from test_loop import tiny
    small = tiny(0, vocab=24, eos=3)
    with pytest.raises(ValueError, match="grammar: the target's vocabulary"):
        generate_ar(small, [[1, 2]], 4, grammar={"regex": "a"})


def test_missing_xgrammar_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r"specdec\[structured\]"):
        XGrammarBackend.byte_vocabulary(VOCAB_SIZE, EOS)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def test_cli_grammar_options(capsys, tmp_path):
    """--json-schema (a file or inline JSON), --regex, --grammar FILE constrain the text; two at once is refused."""
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(ENUMS))
    ebnf_file = tmp_path / "g.ebnf"
    ebnf_file.write_text('root ::= "[" [0-9] "]"')
    base = ["generate", "--no-progress", "--json", "--prompt", "x = ", "--max-new-tokens", "48", "--threads", "1"]
    for extra, check in (
            (["--json-schema", str(schema_file)], lambda t: validates(ENUMS, json.loads(t))),
            (["--json-schema", json.dumps(ENUMS)], lambda t: validates(ENUMS, json.loads(t))),
            (["--regex", "[a-z]{3}"], lambda t: len(t) == 3 and t.isalpha()),
            (["--grammar", str(ebnf_file)], lambda t: len(t) == 3 and t[0] == "[" and t[2] == "]"),
            (["--drafter", "ngram", "--jump-forward", "8", "--json-schema", str(schema_file)],
             lambda t: validates(ENUMS, json.loads(t)))):
        assert cli_main(base + extra) == 0
        text = json.loads(capsys.readouterr().out)["text"][0]
        assert check(text), (extra, text)
    with pytest.raises(SystemExit):
        cli_main(base + ["--regex", "a", "--grammar", str(ebnf_file)])
    assert "not allowed with" in capsys.readouterr().err
    assert cli_main(base + ["--json-schema", "{not json"]) == 2
    assert "--json-schema" in capsys.readouterr().err
