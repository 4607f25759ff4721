"""The guard's ``literal`` check (``controlplane.embedder.literal``): texts with the same
words where the spelling is the subject, and the rewordings it must leave alone."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.embedder import decision, guard
from controlplane.embedder.index import Candidate
from controlplane.embedder.literal import code_conflict, literal_conflict


@pytest.mark.parametrize("a,b", [
    # lines of code, indentation included
    ("Does this Python code run?\nif True:\nprint('hi')",
     "Does this Python code run?\nif True:\n    print('hi')"),
    ("Is this YAML valid?\na:\n  b: 1\n c: 2", "Is this YAML valid?\na:\n  b: 1\n  c: 2"),
    # quoted text: spacing, punctuation, order, and case when short or a capitonym
    ("How long is the string 'a b'?", "How long is the string 'ab'?"),
    ("Does this need a comma: 'However I disagree'?",
     "Does this need a comma: 'However, I disagree'?"),
    ("Is 'therapist' a compound of 'the rapist'?", "Is 'the rapist' a compound of 'therapist'?"),
    ("What does print('A' + 'b') output in Python?", "What does print('a' + 'b') output in Python?"),
    ("Translate 'Polish' into German.", "Translate 'polish' into German."),
    ("Translate 'Polish' into German", "Please translate the word 'polish' into German"),
    ("Is 'We're going home' correct?", "Is 'Were going home' correct?"),
    ("How many spaces are in 'hello  world'?", "How many spaces are in 'hello world'?"),
    # a mark on a word inside a sentence
    ("What does the regex ab? match?", "What does the regex ab match?"),
    ("In Swift, what does x! do?", "In Swift, what does x? do?"),
    ("What does foo! do in Ruby?", "What does foo do in Ruby?"),
    ("What is 5! equal to?", "What is 5 equal to?"),
    # a contraction against the word it spells
    ("Were going home now, right?", "We're going home now, right?"),
    # a capitonym inside a sentence
    ("Is Turkey in Europe?", "Is turkey in Europe?"),
    # a question about the writing itself
    ("Fix the punctuation: hello world", "Fix the punctuation: Hello, world!"),
    ("How many capital letters are in Hello World?", "How many capital letters are in hello world?"),
    # Chinese: the marks cut the text elsewhere
    ("下雨天，留客天，留我不？留！这句话什么意思？", "下雨天留客，天留我不留。这句话什么意思？"),
    # a mark standing alone between words, or in a call's arguments
    ("What does git add . do?", "What does git add do?"),
    ("What does cd .. do in a terminal?", "What does cd . do in a terminal?"),
    ("What does print('Hi' 'there') output in Python?", "What does print('Hi', 'there') output in Python?"),
    # capitonyms, also among Chinese words
    ("What is a Pole?", "What is a pole?"),
    ("这句话里的 Apple 指什么：我买了一个Apple。", "这句话里的 apple 指什么：我买了一个apple。"),
    # questions about a sentence or its writing, in English and Chinese
    ("Is this sentence correct: i like cats.", "Is this sentence correct: I like cats."),
    ("Does this sentence need a question mark: Can you help me",
     "Does this sentence need a question mark: Can you help me?"),
    ("这句话是什么意思：无鸡鸭亦可，无鱼肉亦可。", "这句话是什么意思：无鸡，鸭亦可；无鱼，肉亦可。"),
    ("这句话是什么语气：他说我错了？", "这句话是什么语气：他说我错了。"),
    ("正则表达式 ab? 能匹配字符串 a 吗？", "正则表达式 ab 能匹配字符串 a 吗？"),
    ("在 Swift 中 x! 是什么意思？", "在 Swift 中 x? 是什么意思？"),
    # code: quote marks, quoting, sigil words and nested brackets count
    ("What does `echo $HOME` print in bash?", "What does `echo '$HOME'` print in bash?"),
    ("Is this valid JSON: {'a': 1}", 'Is this valid JSON: {"a": 1}'),
    ("What does SELECT * FROM t WHERE name = 'NULL' return?",
     "What does SELECT * FROM t WHERE name = NULL return?"),
    ("In Python's strftime, what does %S mean?", "In Python's strftime, what does %s mean?"),
    ("In Python, what is type((1))?", "In Python, what is type((1,))?"),
    ("In C, what is the type of 'a'?", 'In C, what is the type of "a"?'),
    # quotes of otherwise equal texts keep their case; and questions about case
    ("In ASCII order, which comes first: 'apple' or 'Banana'?",
     "In ASCII order, which comes first: 'apple' or 'banana'?"),
    ("Is 'Hello World' written in title case?", "Is 'Hello world' written in title case?"),
])
def test_the_same_words_spelled_otherwise_are_another_question(a, b) -> None:
    assert literal_conflict(a, b) and literal_conflict(b, a)
    assert guard.check(a, b).reason == "literal"


@pytest.mark.parametrize("a,b", [
    ("How do I reset my password?", "how do i reset my password"),
    ("WHAT IS THE CAPITAL OF FRANCE", "What is the capital of France?"),
    ("Hello! How do I reset my password?", "Hello, how do I reset my password"),
    ("Why?! Is the sky really blue", "why is the sky really blue"),
    ("How do I set up two-factor login?", "How do I set up two factor login?"),
    ("What are some mind blowing facts about Steve Jobs?",
     "What are some mindblowing facts about Steve Jobs?"),
    ("What does 'ubiquitous' mean?", "What does ubiquitous mean?"),
    ("What is \"white guilt\"?", "What exactly is \"White guilt\"?"),
    ("When do we use \"to\" and \"for\"?", "When do we use \"for\" and \"to\"?"),
    ("What's the time in Tokyo?", "Whats the time in Tokyo?"),
    ("How did Pakistan get its name?", "How did Pakistan get it's name?"),
    ("What are good ways of creating tabs with JQuery", "What are good ways of creating tabs with jQuery?"),
    ("Why do so many fear President Obama?", "Why do so many fear president Obama?"),
    ("你好！怎么重置密码？", "你好，怎么重置密码"),
    ("大汶口文化遗址在我国的哪里", "大汶口文化遗址在我国的：哪里？"),
    ("Is this a good idea? 👍", "is this a good idea 👍"),
    ("What is 2+2?", "what is 2 + 2"),
    ("How much do journalists earn? (Deepak, Arnab)", "How much do journalists earn? (Deepak Arnab)"),
    ("I'm in the top 20 percentile but got 75% (HSC). Am I eligible?",
     "I’m in the top 20 percentile but got 75% (HSC). Am I eligible?"),
    ("What does x = 5 do in Python?", "what does x = 5 do in Python?"),
    ("这句英语如何翻译成中文呀？", "这句英语如何翻译成中文呀"),
    ("• Do Indians lack civic sense? And how?", "Do Indians lack civic sense? And how?"),
    ("Why must a question end with a question mark?", "why must a question end with a question mark?"),
    # a whole text lowercased: its sentences then go on in lower case after their marks
    ("Why were the notes banned? What led to it?", "why were the notes banned? what led to it?"),
])
def test_rewordings_of_spelling_pass(a, b) -> None:
    assert not literal_conflict(a, b) and not literal_conflict(b, a)


def test_completion_prompts_differ_in_anything_but_case() -> None:
    for a, b in (("Once upon a time", "Once upon a time "),
                 ("Roses are red,", "Roses are red."),
                 ("def sub(a, b):\n", "def sub(a, b):\n    ")):
        assert literal_conflict(a, b, verbatim=True)
        assert guard.check(a, b, verbatim=True).reason == "literal"
    assert not literal_conflict("the capital of france is", "The capital of France is",
                                verbatim=True)
    # chat texts: trailing spaces and a final mark are the same question
    assert not literal_conflict("Once upon a time", "Once upon a time ")


def test_the_decision_applies_the_verbatim_rule_it_is_given() -> None:
    rng = np.random.default_rng(0)
    u = rng.standard_normal(8).astype(np.float32)
    u /= np.linalg.norm(u)
    cand = Candidate("e1", 1.0, "Roses are red.", u)
    hit, verdict, _ = decision.choose("Roses are red,", u, [cand], 0.5, None, True, None)
    assert hit is cand and verdict == "pass"
    hit, verdict, _ = decision.choose("Roses are red,", u, [cand], 0.5, None, True, None,
                                      verbatim=True)
    assert hit is None and verdict == "reject:literal"


def test_acronyms_of_a_text_typed_in_lower_case_are_a_rewording() -> None:
    for a, b in (("Should I use a VPN?", "should i use a vpn"),
                 ("How do I center a div in CSS?", "how do I center a div in css")):
        assert guard.check(a, b).ok
    assert guard.check("What is IT?", "What is it?").reason == "symbols"


def test_a_text_typed_in_lower_case_keeps_its_capital_pronoun_i() -> None:
    # phone keyboards capitalise "I" in a text typed in lower case: its capitonyms are
    # then no sign of another word, as without the "I"
    for a, b in (("How do I install Python on a Mac?", "how do I install python on a mac"),
                 ("Can I run Windows on a Chromebook?", "can I run windows on a chromebook"),
                 ("Do I need a visa for China if I'm in transit?",
                  "do I need a visa for china if I'm in transit")):
        assert not literal_conflict(a, b) and not literal_conflict(b, a), (a, b)
    # written in mixed case, a capitonym's case still tells the words apart
    assert literal_conflict("Is Turkey in Europe, I wonder?", "Is turkey in Europe, I wonder?")
    assert literal_conflict("How do I install Python?", "How do I install python?")
    assert guard.check("HOW DO I INSTALL PYTHON", "how do I install python").ok


def test_never_raises_on_odd_text() -> None:
    for a, b in (("", ""), ("'", "''"), ("\n\n", "\n"), ("`", "```"), ("'a", "a'"),
                 ("“”", "「」"), ("\x00?!", "?!\x00"), ("a" * 50000, "A" * 50000)):
        assert literal_conflict(a, b) in (True, False)


@pytest.mark.parametrize("a,b,conflict", [
    ("What does `git status` do?", "What does the git status command do?", False),
    ("What does `git status` do?", "What does the git log command do?", True),
    ("What does `ls  -a` do?", "What does `ls -a` do?", False),        # runs of spaces
    ("docker run -d nginx", "docker run --detach nginx", True),       # options as written
    ("grep -v x", "grep -V x", True),
    ("gcc -O2 -Wall", "gcc -Wall -O2", False),                         # their order aside
    ("Jaish-e -Mohammad chief", "Jaish-e-Mohammad chief", False),      # no option
    ("Is -5 colder than 0?", "Is -5 below 0?", False),
])
def test_code_spans_and_command_line_options(a: str, b: str, conflict: bool) -> None:
    assert code_conflict(a, b) is conflict
    assert code_conflict(b, a) is conflict
