"""Semantic cache with the real all-MiniLM-L6-v2 and a real FAISS index."""

from __future__ import annotations

import json

import pytest

from carpool.cache import SemanticCache, scope_key, semantic_text
from carpool.cache.pairs import decide, load_pairs, score, similarities, verdicts
from carpool.cache.semantic import DEFAULT_THRESHOLD

pytestmark = pytest.mark.real_model

LABEL = {"choices": [{"message": {"role": "assistant", "content": "negative"}}]}


def chat(text: str, system: str = "Answer positive, negative or neutral.", **params) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "temperature": 0, "max_tokens": 4}
    body.update(params)
    return body


@pytest.fixture(scope="module")
def labelled(embedder):
    out = {}
    for split in ("tune", "heldout"):
        pairs = load_pairs(split)
        out[split] = (pairs, similarities(embedder.embed, pairs), verdicts(pairs))
    return out


def test_the_bar_on_the_labelled_set_at_the_default_settings(labelled):
    # The bar: precision >= 0.99 at recall >= 0.8 on the set tuned on.  Measured with
    # all-MiniLM-L6-v2 (docs/cache.md): tune 1.000 / 0.827, held-out 1.000 / 0.793.
    pairs, sims, checked = labelled["tune"]
    result = score(decide(sims, DEFAULT_THRESHOLD, pairs, checked=checked), pairs)
    print(json.dumps(result))
    assert result["precision"] >= 0.99
    assert result["recall"] >= 0.8
    # The held-out split was never tuned on: no false hit there either.
    pairs, sims, checked = labelled["heldout"]
    held = score(decide(sims, DEFAULT_THRESHOLD, pairs, checked=checked), pairs)
    print(json.dumps(held))
    assert held["precision"] >= 0.99
    assert held["recall"] >= 0.7


def test_no_threshold_alone_separates_the_near_misses(labelled):
    # Why the verification stage exists: with similarity alone some near miss scores above
    # every threshold that keeps recall (role swaps reach 0.999).
    pairs, sims, _ = labelled["tune"]
    for threshold in (0.95, 0.98):
        plain = score(decide(sims, threshold, pairs, verify=False), pairs)
        legacy = score(decide(sims, threshold, pairs, verify="legacy"), pairs)
        assert plain["false_hits"] > 0 and legacy["false_hits"] > 0, threshold


def test_the_two_false_hits_of_the_issue_are_misses_and_paraphrases_still_hit(tmp_path, embedder):
    sem = SemanticCache(tmp_path / "sem", embedder=embedder)
    stored = ["Who wrote the letter, Alice or Bob? Alice wrote to Bob.", "Which is larger, a cat or a dog?"]
    sem.add_many([("s", t, {"answer": i}) for i, t in enumerate(stored)])
    # Two false hits once seen (similarity 0.999 and 0.971 to the stored texts).
    assert sem.lookup("s", "Who wrote the letter, Alice or Bob? Bob wrote to Alice.") is None
    assert sem.lookup("s", "Which is smaller, a cat or a dog?") is None
    assert sem.stats()["verify_rejections_by_reason"] == {"comparative": 1, "order": 1}
    # The same questions re-written still hit, and say which entry answered.
    hits = sem.lookup_many([("s", "who wrote the letter - Alice or Bob?  Alice wrote to Bob!"),
                            ("s", "Which is larger, a dog or a cat?"),
                            ("s", "Wich is larger, a cat or a dog")])
    assert [h.response if h else None for h in hits] == [{"answer": 0}, {"answer": 1}, {"answer": 1}]
    first = sem.lookup_many([("s", stored[0])])[0]
    assert hits[0].entry_id == first.entry_id != hits[1].entry_id
    assert all(DEFAULT_THRESHOLD <= h.similarity <= 1.0 for h in hits)
    assert sem.hit_log[-1]["entry_id"] == first.entry_id
    sem.close()


def test_paraphrase_hits_with_its_similarity_and_negation_misses(tmp_path, embedder):
    sem = SemanticCache(tmp_path / "sem", embedder=embedder)
    body = chat("My order arrived broken and nobody helped me.")
    scope = scope_key(model="m", endpoint="/v1/chat/completions", body=body)
    assert sem.lookup(scope, semantic_text(body)) is None  # empty
    assert sem.add(scope, semantic_text(body), LABEL)
    paraphrase = chat("My order arrived broken, and nobody helped me at all.")
    assert scope_key(model="m", endpoint="/v1/chat/completions", body=paraphrase) == scope
    hit = sem.lookup(scope, semantic_text(paraphrase))
    assert hit is not None
    response, similarity = hit
    assert response == LABEL
    assert DEFAULT_THRESHOLD <= similarity <= 1.0
    assert sem.lookup(scope, "My order arrived intact and the support team helped me.") is None
    stats = sem.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (1, 2, 1)
    assert stats["hit_similarity_min"] == pytest.approx(similarity)
    assert sem.hit_log[0]["matched"] == "My order arrived broken and nobody helped me."
    sem.close()


def test_never_crosses_scopes(tmp_path, embedder):
    sem = SemanticCache(tmp_path / "sem", embedder=embedder)
    text = "The battery lasts all day and the screen is bright."
    scopes = {
        "base": scope_key(model="m", endpoint="e", body=chat(text)),
        "system": scope_key(model="m", endpoint="e", body=chat(text, system="Is it spam? yes or no.")),
        "model": scope_key(model="other", endpoint="e", body=chat(text)),
        "max_tokens": scope_key(model="m", endpoint="e", body=chat(text, max_tokens=5)),
        "seed": scope_key(model="m", endpoint="e", body=chat(text, seed=3)),
    }
    assert len(set(scopes.values())) == len(scopes)
    sem.add(scopes["base"], text, LABEL)
    for name, scope in scopes.items():
        hit = sem.lookup(scope, text)
        if name == "base":
            assert hit is not None and hit[1] == pytest.approx(1.0, abs=1e-4)
        else:
            assert hit is None, name
    sem.close()


def test_persistence_across_reopen_and_rebuild(tmp_path, embedder):
    folder = tmp_path / "sem"
    sem = SemanticCache(folder, embedder=embedder)
    scope = scope_key(model="m", endpoint="e", body=chat("x"))
    texts = ["Where is my package?", "How do I reset my password?", "Cancel my subscription please."]
    assert sem.add_many([(scope, t, {"label": i}) for i, t in enumerate(texts)]) == [True, True, True]
    assert sem.add(scope, "Where is my package?", {"label": 99}) is False  # known text: not stored twice
    sem.close()
    assert list((folder / "index").glob("*.faiss"))

    reopened = SemanticCache(folder, embedder=embedder)
    hits = reopened.lookup_many([(scope, "Where's my package?"), (scope, "Please cancel my subscription."),
                                 (scope, "What is the weather today?")])
    assert hits[0] is not None and hits[0][0] == {"label": 0}
    assert hits[1] is not None and hits[1][0] == {"label": 2}
    assert hits[2] is None
    reopened.close()

    for f in (folder / "index").glob("*"):  # lost index files: rebuilt from the table
        f.unlink()
    rebuilt = SemanticCache(folder, embedder=embedder)
    assert rebuilt.lookup(scope, "How can I reset my password?")[0] == {"label": 1}
    assert len(rebuilt) == 3
    rebuilt.clear()
    assert rebuilt.lookup(scope, "Where is my package?") is None
    rebuilt.close()


def test_a_second_process_entries_are_seen_after_reopen(tmp_path, embedder):
    folder = tmp_path / "sem"
    scope = scope_key(model="m", endpoint="e", body=chat("x"))
    first = SemanticCache(folder, embedder=embedder)
    first.add(scope, "The coffee tastes burnt and bitter.", {"label": "negative"})
    first.save()
    second = SemanticCache(folder, embedder=embedder)  # as another process would
    second.add(scope, "Great quality fabric, fits perfectly.", {"label": "positive"})
    second.close()
    first.close()
    third = SemanticCache(folder, embedder=embedder)
    assert third.lookup(scope, "The coffee tastes bitter and burnt.")[0] == {"label": "negative"}
    assert third.lookup(scope, "Great quality fabric. Fits perfectly.")[0] == {"label": "positive"}
    third.close()


def test_numbers_must_match(tmp_path, embedder):
    sem = SemanticCache(tmp_path / "sem", threshold=0.5, embedder=embedder)
    sem.add("s", "Order 1234 has not arrived yet.", {"label": "late"})
    assert sem.lookup("s", "Order 1235 has not arrived yet.") is None
    assert sem.lookup("s", "Order 1234 has not arrived yet!") is not None
    assert sem.stats()["verify_rejections_by_reason"] == {"number": 1}
    sem.close()


def test_bad_threshold_is_a_readable_error(tmp_path):
    with pytest.raises(ValueError, match="cosine similarity"):
        SemanticCache(tmp_path, threshold=1.5, embedder=lambda t: None)


def test_texts_longer_than_the_embedder_reads_are_never_matched(tmp_path, embedder):
    sem = SemanticCache(tmp_path / "sem", embedder=embedder)
    head = " ".join(["word"] * 300)  # past MiniLM's 256 word pieces: the endings would be cut off
    assert sem.add("s", "word word word", LABEL)  # so the scope's index is not empty
    assert sem.add("s", head + " positive", LABEL) is False
    assert sem.lookup("s", head + " negative") is None
    stats = sem.stats()
    assert (stats["entries"], stats["skipped_too_long"]) == (1, 1)
    sem.close()


def test_concurrent_threads_share_one_cache(tmp_path, embedder):
    # The batch runner calls lookup/add from worker threads (asyncio.to_thread).
    from concurrent.futures import ThreadPoolExecutor

    sem = SemanticCache(tmp_path / "sem", embedder=embedder)
    scope = scope_key(model="m", endpoint="e", body=chat("x"))
    texts = [f"Ticket {i}: the parcel was late." for i in range(12)]

    def work(i: int):
        sem.add(scope, texts[i], {"label": i})
        return sem.lookup(scope, texts[i] + "!")

    with ThreadPoolExecutor(max_workers=4) as pool:
        found = list(pool.map(work, range(len(texts))))
    assert len(sem) == len(texts)
    # The number guard keeps every ticket on its own entry.
    assert [f[0]["label"] if f else None for f in found] == list(range(len(texts)))
    sem.close()


def test_a_near_spelling_of_a_place_is_another_place_not_a_typo(tmp_path, embedder):
    """Malta cached: Yalta (0.52 to it) and, with Paris cached, Paros (0.58 to 0.80 by wording)
    were hits that served the other place's answer.  Each is a miss now, named as a different
    word; a misspelt ordinary word beside the name still hits."""
    sem = SemanticCache(tmp_path / "sem", embedder=embedder)  # the default threshold, 0.4
    stored = ["Is Malta an island? Answer yes or no.", "Is Paris an island? Answer yes or no.",
              "What is the population of Paris?"]
    sem.add_many([("s", t, {"answer": i}) for i, t in enumerate(stored)])
    for query in ("Is Yalta an island? Answer yes or no.", "is yalta an island? answer yes or no.",
                  "Is Paros an island? Answer yes or no.", "What is the population of Paros?"):
        assert sem.lookup("s", query) is None, query
    assert sem.stats()["verify_rejections_by_reason"].get("word", 0) >= 4
    hit = sem.lookup("s", "Is Malta an iland? Answer yes or no.")
    assert hit is not None and hit[0] == {"answer": 0}
    sem.close()
