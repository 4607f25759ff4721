"""The closed classes of :mod:`.contrast`: English words whose members answer different
questions (and, by pattern, a few Chinese forms: 一行 / 所有行, 发货 / 到货). Lowercase single words
(matched whole); a member is the tuple of its forms.
Ambiguous forms are left out or matched by a pattern in :data:`PATTERNS` instead: ``may``
(the verb; the month only as "in May", "May 5"), ``one`` (a quantity only before what it
counts: "one photo", not "no one" or "one of"), ``us`` (the pronoun; the country only
as "US"), ``am`` / ``pm`` (only after a time, "9 am"), ``in`` / ``out`` (only in "zoom
in", "opt out" and the like), ``fall`` and ``spring``, ``right``, ``second`` and ``min``.
"""

from __future__ import annotations

import re

#: (class name, members).
CONTRASTS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("weekday", (("monday", "mondays"), ("tuesday", "tuesdays"), ("wednesday", "wednesdays"),
                 ("thursday", "thursdays"), ("friday", "fridays"), ("saturday", "saturdays"),
                 ("sunday", "sundays"))),
    ("month", (("january",), ("february",), ("march",), ("april",), ("may-month",),
               ("june",), ("july",), ("august",), ("september",), ("october",),
               ("november",), ("december",))),
    ("season", (("summer", "summers"), ("winter", "winters"), ("autumn", "autumns"))),
    ("day", (("today",), ("tomorrow",), ("yesterday",))),
    ("relative time", (("rel-this",), ("rel-last",), ("rel-next",))),
    ("part of day", (("morning", "mornings"), ("afternoon", "afternoons"),
                     ("evening", "evenings"), ("night", "nights", "tonight"))),
    ("meridiem", (("am-time",), ("pm-time",))),
    ("compass", (("north", "northern"), ("south", "southern"), ("east", "eastern"),
                 ("west", "western"))),
    ("temperature", (("hot", "hotter", "hottest"), ("warm", "warmer", "warmest"),
                     ("cool", "cooler", "coolest"), ("cold", "colder", "coldest"))),
    ("hardness", (("soft", "softer", "softest"), ("hard", "harder", "hardest", "firm",
                                                   "firmer"))),
    ("size", (("small", "smaller", "smallest", "tiny"),
              ("large", "larger", "largest", "big", "bigger", "biggest", "huge"))),
    ("height", (("high", "higher", "highest"), ("low", "lower", "lowest"))),
    ("vertical", (("up", "upward", "upwards", "upstairs"),
                  ("down", "downward", "downwards", "downstairs"))),
    ("in/out", (("in-phrase",), ("out-phrase",))),
    ("speed", (("fast", "faster", "fastest", "quick", "quicker", "quickest", "quickly"),
               ("slow", "slower", "slowest", "slowly"))),
    ("time", (("early", "earlier", "earliest"), ("late", "later", "latest"))),
    ("open/close", (("open", "opens", "opened", "opening"),
                    ("close", "closes", "closed", "closing"))),
    ("start/stop", (("start", "starts", "started", "starting"),
                    ("stop", "stops", "stopped", "stopping"))),
    ("price", (("cheap", "cheaper", "cheapest", "inexpensive"),
               ("expensive", "costly", "pricey"))),
    ("good/bad", (("good",), ("bad",))),
    ("wet/dry", (("wet", "wetter"), ("dry", "drier", "dryer"))),
    ("thick/thin", (("thick", "thicker"), ("thin", "thinner"))),
    ("full/empty", (("full",), ("empty",))),
    ("dark/light", (("dark", "darker"), ("light", "lighter"))),
    ("public/private", (("public",), ("private",))),
    ("junior/senior", (("junior",), ("senior",))),
    ("odd/even", (("odd",), ("even",))),
    ("case", (("uppercase", "upper"), ("lowercase",))),
    ("order", (("ascending", "asc"), ("descending", "desc"))),
    ("input/output", (("input", "inputs"), ("output", "outputs"))),
    ("read/write", (("read", "reading", "reads"), ("write", "writing", "writes"))),
    ("send/receive", (("send", "sending", "sent", "sender"),
                      ("receive", "receiving", "received", "receiver", "recipient"))),
    ("borrow/lend", (("borrow", "borrowing", "borrowed"), ("lend", "lending", "lent"))),
    # who hands it over: "How do I get a refund?" / "How do I give a refund?" ("given" is
    # left out: "been given" is to get, "given that" neither)
    ("give/get", (("give", "gives", "giving", "gave"),
                  ("get", "gets", "getting", "got", "gotten", "obtain", "obtained"))),
    ("push/pull", (("push", "pushing"), ("pull", "pulling"))),
    ("arithmetic", (("add", "addition", "plus"), ("subtract", "subtraction", "minus"),
                    ("multiply", "multiplication"), ("divide", "division"))),
    ("win/lose", (("win", "wins", "won", "winning"), ("lose", "loses", "lost", "losing"))),
    ("accept/reject", (("accept", "accepted", "accepting"),
                       ("reject", "rejected", "rejecting", "decline", "declined"))),
    ("allow/block", (("allow", "allowed", "allowing", "permit", "permitted"),
                     ("block", "blocked", "blocking", "ban", "banned", "forbid", "forbidden"))),
    ("positive/negative", (("positive",), ("negative",))),
    ("inside/outside", (("inside", "indoor", "indoors"), ("outside", "outdoor", "outdoors"))),
    ("first/last", (("first",), ("last",))),
    ("quantifier", (("all", "every", "everything", "everyone", "everybody", "each", "entire"),
                    ("some", "any", "anything", "anyone", "anybody", "something", "someone",
                     "several"), ("none", "nothing", "nobody"))),
    ("one/all", (("one-item",), ("all-item",), ("alternate-item",))),
    ("obligation", (("must",), ("should", "ought"))),
    ("permission", (("can-ask",), ("must-ask",))),
    ("actor", (("actor-self",), ("actor-other",))),
    ("gender", (("male", "males", "man", "men", "boy", "boys", "masculine"),
                ("female", "females", "woman", "women", "girl", "girls", "feminine"))),
    ("pronoun", (("he", "him", "his", "himself"), ("she", "her", "hers", "herself"))),
    ("family", (("mother", "mom", "mum"), ("father", "dad"), ("son", "sons"),
                ("daughter", "daughters"), ("brother", "brothers"), ("sister", "sisters"),
                ("husband",), ("wife",), ("grandmother", "grandma"),
                ("grandfather", "grandpa"), ("aunt",), ("uncle",), ("nephew",), ("niece",))),
    ("role", (("employer",), ("employee",))),
    ("tenancy", (("landlord",), ("tenant",))),
    ("trade", (("buyer", "buyers"), ("seller", "sellers"))),
    ("teaching", (("teacher", "teachers"), ("student", "students"))),
    ("client/server", (("client", "clients"), ("server", "servers"))),
    ("colour", (("red",), ("yellow",), ("green",), ("blue",), ("purple",), ("pink",),
                ("black",), ("white",), ("brown",), ("gray", "grey"))),
    ("language", (("english",), ("french",), ("spanish",), ("german",), ("italian",),
                  ("portuguese",), ("russian",), ("chinese", "mandarin"), ("japanese",),
                  ("korean",), ("arabic",), ("hindi",), ("dutch",), ("swedish",),
                  ("norwegian",), ("danish",), ("polish",), ("greek",))),
    ("country", (("usa", "america", "us-country"), ("uk", "britain", "england"),
                 ("canada",), ("australia",), ("india",), ("germany",), ("france",),
                 ("japan",), ("china",), ("mexico",), ("brazil",), ("spain",), ("italy",),
                 ("russia",), ("ireland",), ("singapore",), ("korea",),
                 ("netherlands", "holland"), ("sweden",), ("norway",), ("switzerland",))),
    ("number", (("one",), ("two",), ("three",), ("four",), ("five",), ("six",), ("seven",),
                ("eight",), ("nine",), ("ten",), ("eleven",), ("twelve",), ("twenty",),
                ("thirty",), ("fifty",), ("hundred", "hundreds"), ("thousand", "thousands"),
                ("million", "millions"), ("billion", "billions"), ("half", "halves"),
                ("third", "thirds"), ("quarter", "quarters"), ("dozen", "dozens"))),
    ("distance", (("km", "kms", "kilometer", "kilometers", "kilometre", "kilometres"),
                  ("mile", "miles"), ("meter", "meters", "metre", "metres"),
                  ("foot", "feet", "ft"), ("inch", "inches"), ("yard", "yards"),
                  ("cm", "centimeter", "centimeters", "centimetre", "centimetres"),
                  ("mm", "millimeter", "millimeters", "millimetre", "millimetres"))),
    ("mass", (("kg", "kgs", "kilogram", "kilograms", "kilo", "kilos"),
              ("lb", "lbs", "pound", "pounds"), ("gram", "grams"), ("ounce", "ounces", "oz"),
              ("ton", "tons", "tonne", "tonnes"))),
    ("temperature unit", (("celsius", "centigrade"), ("fahrenheit",), ("kelvin",))),
    ("duration", (("seconds", "sec", "secs"), ("minute", "minutes", "mins"),
                  ("hour", "hours", "hr", "hrs"), ("day-unit",), ("week", "weeks"),
                  ("month", "months"), ("year", "years"))),
    ("data size", (("kb", "kilobyte", "kilobytes"), ("mb", "megabyte", "megabytes"),
                   ("gb", "gigabyte", "gigabytes"), ("tb", "terabyte", "terabytes"),
                   ("bit", "bits"), ("byte", "bytes"))),
    ("shipping", (("ship-dispatch",), ("ship-arrive",), ("ship-return",))),
    ("currency", (("dollar", "dollars", "usd"), ("euro", "euros", "eur"), ("yen", "jpy"),
                  ("rupee", "rupees", "inr"), ("yuan", "rmb", "cny"), ("peso", "pesos"),
                  ("bitcoin", "btc"))),
)

#: (pattern on the original text, its form in :data:`CONTRASTS`): the forms that need
#: their context.
#: Spans of time named from now: "this year" / "last year" / "next year".
_PERIOD = (r"(?:week|weekend|month|year|semester|term|quarter|season|summer|winter|spring|"
           r"fall|autumn|night|time|monday|tuesday|wednesday|thursday|friday|saturday|"
           r"sunday)\b")

PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # a span of time named from now, this one against the last or the next ("sales this
    # month" / "sales last month", "open this Sunday" / "next Sunday"); "last" alone is
    # also of first / last
    (re.compile(r"\b(?:this|current)\s+" + _PERIOD + r"|\btonight\b", re.IGNORECASE),
     "rel-this"),
    (re.compile(r"\b(?:last|previous|past)\s+" + _PERIOD, re.IGNORECASE), "rel-last"),
    (re.compile(r"\b(?:next|coming|upcoming)\s+" + _PERIOD, re.IGNORECASE), "rel-next"),
    (re.compile(r"\b(?:in|of|on|during|since|until|by|early|late|mid|next|last|this)"
                r"\s+May\b|\bMay\s+\d"), "may-month"),
    (re.compile(r"\bUS\b|\bU\.S\.(?!\w)"), "us-country"),
    (re.compile(r"\d\s*(?:am|a\.m\.)(?!\w)", re.IGNORECASE), "am-time"),
    (re.compile(r"\d\s*(?:pm|p\.m\.)(?!\w)", re.IGNORECASE), "pm-time"),
    (re.compile(r"\b(?:zoom|opt|check|plug|clock|cash|log|sign|logged|signed)[- ]in\b",
                re.IGNORECASE), "in-phrase"),
    (re.compile(r"\b(?:zoom|opt|check|unplug|clock|cash|log|sign|logged|signed)[- ]out\b",
                re.IGNORECASE), "out-phrase"),
    (re.compile(r"\b(?:days?|per day|a day)\b", re.IGNORECASE), "day-unit"),
    # "one" / "a single" before the thing counted ("unsubscribe from one list" / "from
    # all lists"), not the pronoun ("how can one stop", "what should one do") nor "no
    # one", "the one", "which one", "one of", "one more", "one way"
    (re.compile(r"(?<!\bno )(?<!\bthe )(?<!\bany )(?<!\bevery )(?<!\bwhich )(?<!\bthis )"
                r"(?<!\bthat )(?<!\bcan )(?<!\bcould )(?<!\bshould )(?<!\bwould )"
                r"(?<!\bmust )(?<!\bwill )(?<!\bmay )(?<!\bmight )(?<!\bdoes )(?<!\bdo )"
                r"(?<!\bif )(?<!\bhow )(?<!\bwhat )(?<!\bwhen )(?<!\bwhere )(?<!\bwhy )"
                r"(?<!\bwhom )\b(?:one|single)\s+(?!(?:of|another|more|or|and|by|"
                r"day|time|way|at|to|is|was|can|should|would|will|thing|has|had|have|needs?|"
                r"must|may|might|could|does|did|gets?|in|on|for|with|that|who|which|i|you|we|they|"
                r"he|she|it)\b)[a-z]", re.IGNORECASE), "one-item"),
    (re.compile(r"\b(?:one|a single) of (?:my|your|our|his|her|their|these|those)\b",
                re.IGNORECASE), "one-item"),
    # (against "one", not "any": "if you could change one law" / "any law" is a rewording)
    (re.compile(r"\b(?:all|every|each|entire)\b(?! other\b)", re.IGNORECASE), "all-item"),
    (re.compile(r"\bevery (?:other|second|alternate)\b|\balternate\b", re.IGNORECASE),
     "alternate-item"),
    # the same in Chinese: 删除一行 / 删除所有行 (一 with a measure word, against 所有 or
    # 每; not a span of time, 一个月的利息 / 每个月的利息, nor the adverb 全部, 全部还清)
    (re.compile(r"(?<![第十百千万几])一(?:个(?!月|小时|星期|礼拜|季度|工作日)|行|列|张|条|份|项|"
                r"页|件|封|笔|台|篇|首|部|本|位)"), "one-item"),
    (re.compile(r"所有|每一?(?:个(?!月|小时|星期|礼拜|季度|工作日)|行|列|张|条|份|项|页|件|封|"
                r"笔|台|篇|首|部|本|位)"), "all-item"),
    # an order's stages in Chinese: sent out (发货), arrived (到货, 送达, "什么时候到？"),
    # sent back (退货): 订单什么时候发货 / 订单什么时候到货 ask different things
    (re.compile(r"发货|发出|寄出|出库|发快递"), "ship-dispatch"),
    (re.compile(r"到货|送达|寄到|送到|收到货|到(?=\s*(?:吗|呢|啊|了吗)?\s*[？?。!！]?\s*$)"),
     "ship-arrive"),
    (re.compile(r"退货|退回去|寄回"), "ship-return"),
    # a question asking leave ("Can I pay rent by card?") against one asking whether it
    # is required ("Must I ...?", "Do I have to ...?"); "should" is neither
    (re.compile(r"^\W*(?:can|could|may)\s+(?:i|we|you|one)\b", re.IGNORECASE), "can-ask"),
    (re.compile(r"^\W*(?:must\s+(?:i|we|you|one)|(?:do|does)\s+(?:i|we|you|one)\s+"
                r"(?:have|need)\s+to|(?:am\s+i|are\s+(?:we|you)|is\s+one)\s+required\s+to)\b",
                re.IGNORECASE), "must-ask"),
    # who acts in a condition: the asker ("if I cancel my flight"; a generic "you" is the
    # asker too) or someone else ("if the airline cancels my flight", "if they cancel",
    # "if my landlord breaks the lease", "if someone hits my car")
    (re.compile(r"\b(?:if|when|unless)\s+(?:i|we|you)\b", re.IGNORECASE), "actor-self"),
    (re.compile(r"\b(?:if|when|unless)\s+(?:he|she|they|the|someone|somebody|my|your|our|"
                r"his|her|their)\b",
                re.IGNORECASE), "actor-other"),
)

#: Negating prefixes: "safe" / "unsafe", "effective" / "ineffective", "normal" /
#: "abnormal"; (prefix, the least length of the word it negates).
PREFIXES: tuple[tuple[str, int], ...] = (
    ("un", 3), ("in", 4), ("im", 4), ("ir", 4), ("il", 4), ("dis", 4), ("non", 3),
    ("ab", 5), ("de", 5), ("anti", 4),
)
