"""The guard's checks of a question's time, audience and kind (controlplane/embedder/
scope.py, called by guard.check): the pairs they reject, and the rewordings they leave
to the rest of the decision."""

from __future__ import annotations

import pytest

from controlplane.embedder import guard


@pytest.mark.parametrize("a,b,reason", [
    ("What did Apple announce?", "What will Apple announce?", "tense"),
    ("Who won the election?", "Who'll win the election?", None),   # "won": no auxiliary
    ("What was the weather in Paris?", "What'll the weather be in Paris?", "tense"),
    ("What vaccines do I need for Thailand?", "What vaccines do children need for Thailand?",
     "audience"),
    ("Is there a discount?", "Is there a discount for students?", "audience"),
    ("Is ibuprofen safe for adults?", "Is ibuprofen safe for kids?", "audience"),
    ("孩子发烧怎么办？", "老人发烧怎么办？", "audience"),
    ("What is a 404 error?", "How do I fix a 404 error?", "question_type"),
    ("什么是死锁？", "怎么解决死锁？", "question_type"),
])
def test_time_audience_and_kind_reject(a: str, b: str, reason: str | None) -> None:
    for q, c in ((a, b), (b, a)):
        got = guard.check(q, c)
        if reason is None:
            assert got.reason not in ("tense", "audience", "question_type"), (q, c)
        else:
            assert not got.ok and got.reason == reason, (q, c, got)


@pytest.mark.parametrize("a,b", [
    ("What happens if I miss a payment?", "What will happen if I miss a payment?"),
    ("Is this toy safe for kids?", "Is this toy safe for children?"),
    ("小孩发烧怎么办？", "儿童发烧怎么办？"),
    ("How do I fix a flat tire?", "What is the way to fix a flat tire?"),
    ("What is a 404 error and how do I fix it?", "How do I fix a 404 error?"),
    ("How can I reset my password?", "How do I reset my password?"),
])
def test_rewordings_pass_these_checks(a: str, b: str) -> None:
    for q, c in ((a, b), (b, a)):
        assert guard.check(q, c).reason not in ("tense", "audience", "question_type"), (q, c)
