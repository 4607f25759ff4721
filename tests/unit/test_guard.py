"""Precision guard: pure functions, checked on pairs that embeddings confuse."""

from __future__ import annotations

import pytest

from controlplane.embedder import contrast, guard, scope


@pytest.mark.parametrize("query,candidate,reason", [
    ("借款1万", "借款5万", "numbers"),
    ("借款1万需要什么条件", "借款一万五需要什么条件", "numbers"),
    ("分三个月还", "分六个月还", "numbers"),
    ("How do I transfer 500 dollars?", "How do I transfer 5000 dollars?", "numbers"),
    ("python 3.10 install", "python 3.1 install", "numbers"),
    ("Best phone under 10,000", "Best phone under 20,000", "numbers"),
    ("How to transfer 500 dollars", "How to transfer dollars", "numbers"),
    ("How do I enable two-factor login?", "How do I disable two-factor login?",
     "antonym:enable/disable"),
    ("Can I pay with a card?", "Can't I pay with a card?", "negation"),
    ("Can I pay with a card?", "Can I not pay with a card?", "negation"),
    ("Why does it work", "Why doesn’t it work", "negation"),
    ("Hello, I can log in to my account", "Hello, I can hardly log in to my account",
     "negation"),
    ("My card works at ATMs, why?", "My card barely works at ATMs, why?", "negation"),
    ("I can log in to my account but it is slow", "I can scarcely log in to my account but "
     "it is slow", "negation"),
    ("Why does my app crash when I open it?", "Why does my app rarely crash when I open it?",
     "negation"),
    ("Why can I log in to my bank account?", "Why can I seldom log in to my bank account?",
     "negation"),
    ("我能借款吗", "我不能借款吗", "negation"),
    ("我有借款", "我没有借款", "negation"),
    ("微粒贷怎么还款", "微粒贷怎么借款", "antonym:借/还"),
    ("怎么开通微粒贷", "怎么关闭微粒贷", "antonym:开通/关闭"),
    ("额度可以提高吗", "额度可以降低吗", "antonym:增加/减少"),
    ("What is the best phone?", "What is the worst phone?", "antonym:max/min"),
    ("How to upload photos", "How to download photos", "antonym:upload/download"),
    ("重庆到西安的火车票", "西安到重庆的火车票", "order"),
    ("为什么我左脸比右脸大?", "为什么我右脸比左脸大?", "order"),
    ("How to convert pdf to word", "How to convert word to pdf", "order"),
    ("Find flights from London to New York", "Find flights from New York to London", "order"),
    ("Is Bob taller than Alice?", "Is Alice taller than Bob?", "order"),
    ("从北京到上海的火车票", "从上海到北京的火车票", "order"),
    ("5英里等于多少公里？", "5公里等于多少英里？", "order"),
    ("Do I owe you money?", "Do you owe me money?", "persons"),
    ("Can you help me?", "Can I help you?", "persons"),
    ("What do you think of me?", "What do I think of you?", "persons"),
    ("Should I trust you?", "Should you trust me?", "persons"),
    ("你欠我钱吗", "我欠你钱吗", "persons"),
    ("我不配做你男朋友是谁唱的", "你不配做我的男朋友是谁唱的", "persons"),
    ("皖是哪个省会的简称", "滇是哪个省会的简称", "key_terms"),
    ("重设密码", "重置密钥", "key_terms"),   # synonyms read as one, the object still differs
    ("彬字的行书怎么写", "焱字的行书是怎么写", "key_terms"),
    ("What is the capital of France?", "What is the capital of Germany?", "contrast:country"),
    ("What is the capital of Peru?", "What is the capital of Chile?", "key_terms"),
    ("Shotgun safety rules in Wisconsin", "Shotgun safety rules in Michigan", "key_terms"),
    ("???", "!!!", "no_words"),
    ("\x00", "\x01\x02\x03", "no_words"),
    ("👍", "👎", "no_words"),
    ("Is this a good idea? 👍", "Is this a good idea? 👎", "symbols"),
    ("Reply with the emoji 😀", "Reply with the emoji 😡", "symbols"),
    ("What does ⠓ mean in braille?", "What does ⠁ mean in braille?", "symbols"),
    ("Price in $ please", "Price in € please", "symbols"),
    # operators and signs (controlplane/embedder/operators.py)
    ("What is 8/2?", "What is 8*2?", "symbols"),
    ("What is 20/4?", "What is 20-4?", "symbols"),
    ("How do I learn C#?", "How do I learn C?", "symbols"),
    ("What is -5 squared?", "What is 5 squared?", "symbols"),
    ("What is 10% of 200?", "What is 10 of 200?", "symbols"),
    ("What is 7 % 3 in Python?", "What is 7 // 3 in Python?", "symbols"),
    ("What does x++ return in C?", "What does ++x return in C?", "symbols"),
    ("What does the ! operator do in JavaScript?",
     "What does the ? operator do in JavaScript?", "symbols"),
    ("Is a && b true?", "Is a b true?", "symbols"),
    # another member of a closed class (controlplane/embedder/contrast.py)
    ("Is the pharmacy open on Tuesdays?", "Is the pharmacy open on Thursdays?",
     "contrast:weekday"),
    ("Best places to visit in October", "Best places to visit in December", "contrast:month"),
    ("What were our sales this month?", "What were our sales last month?",
     "contrast:relative time"),
    ("Is the museum open this Sunday?", "Is the museum open next Sunday?",
     "contrast:relative time"),
    ("Who won the game last night?", "Who won the game tonight?", "contrast:relative time"),
    ("Should I wear a coat in winter there?", "Should I wear a coat in summer there?",
     "contrast:season"),
    ("How to say thank you in French", "How to say thank you in Spanish", "contrast:language"),
    ("Why is my cat's tongue pink?", "Why is my cat's tongue black?", "contrast:colour"),
    ("Gift ideas for my mother", "Gift ideas for my father", "contrast:family"),
    ("How long to grill a thick steak", "How long to grill a thin steak", "contrast:thick/thin"),
    ("How do I start the backup service?", "How do I stop the backup service?",
     "contrast:start/stop"),
    ("Why does my phone charge slowly?", "Why does my phone charge fast?", "contrast:speed"),
    ("Cheapest flights to Tokyo", "Most expensive flights to Tokyo", "contrast:price"),
    ("What time does the museum open?", "What time does the museum close?",
     "contrast:open/close"),
    ("Is the museum open in May?", "Is the museum open in June?", "contrast:month"),
    ("Is the ferry at 7 am?", "Is the ferry at 7 pm?", "contrast:meridiem"),
    ("How do I zoom in on a PDF?", "How do I zoom out on a PDF?", "contrast:in/out"),
    ("Do I need a visa for the US?", "Do I need a visa for the UK?", "contrast:country"),
    ("Did he call her back?", "Did she call him back?", "contrast:pronoun"),
    ("How many grams in a pound?", "How many grams in a kilogram?", "contrast:mass"),
    ("Is the data consistent?", "Is the data inconsistent?", "contrast:prefix"),
    ("Is the bridge stable?", "Is the bridge unstable?", "contrast:prefix"),
    ("Is this plugin useful?", "Is this plugin useless?", "contrast:prefix"),
    ("Is the drug non-toxic?", "Is the drug toxic?", "contrast:prefix"),
    ("How do I write a non-blocking socket?", "How do I write a blocking socket?",
     "contrast:prefix"),
    # the same letters and digits, marks in other places, an acronym or an option's case
    ("What does a[1:] return in Python?", "What does a[:1] return in Python?", "symbols"),
    ("What does s[::-1] do?", "What does s[:-1] do?", "symbols"),
    ("Explain the expression (a+b)*c", "Explain the expression a+(b*c)", "symbols"),
    ("What is *p++ in C?", "What is (*p)++ in C?", "symbols"),
    ("Solve x^2 = 4", "Solve -x^2 = 4", "symbols"),
    ("What is the derivative of sin(x)?", "What is the derivative of sin(-x)?", "symbols"),
    ("Is f(x) = -x increasing?", "Is f(x) = x increasing?", "symbols"),
    ("Is rm -rf / safe?", "Is rm -rf ./ safe?", "symbols"),
    ("What does grep -v do?", "What does grep -V do?", "symbols"),
    ("What is IT?", "What is it?", "symbols"),
    ("What does a -> b mean?", "What does b -> a mean?", "symbols"),
    # a long shared context with another question or instruction in it
    ("Our refund policy: items can be returned within 30 days with a receipt. Opened "
     "software and gift cards cannot be returned. Shipping fees are not refunded. "
     "Question: Can I return gift cards?",
     "Our refund policy: items can be returned within 30 days with a receipt. Opened "
     "software and gift cards cannot be returned. Shipping fees are not refunded. "
     "Question: Can I return a laptop?", "context"),
    ("The board met on Monday to discuss the dividend. The CFO presented the numbers. "
     "Who approved the dividend?",
     "The board met on Monday to discuss the dividend. The CFO presented the numbers. "
     "Who opposed the dividend?", "context"),
    ("Quarterly report: revenue grew in Europe while costs in Asia rose sharply. "
     "Summarize this briefly.",
     "Quarterly report: revenue grew in Europe while costs in Asia rose sharply. "
     "List every risk mentioned, as bullet points.", "context"),
    # time, audience and kind of question (controlplane/embedder/scope.py)
    ("What did Apple announce?", "What will Apple announce?", "tense"),
    ("What was the weather in Paris?", "What'll the weather be in Paris?", "tense"),
    ("Who is the president of France?", "Who was the president of France?", "tense"),
    ("What is the tallest building in the world?", "What was the tallest building in the world?",
     "tense"),
    ("Does the museum open on Mondays?", "Did the museum open on Mondays?", "tense"),
    ("What vaccines do I need for Thailand?", "What vaccines do children need for Thailand?",
     "audience"),
    ("Is there a discount?", "Is there a discount for students?", "audience"),
    ("Is ibuprofen safe for adults?", "Is ibuprofen safe for kids?", "audience"),
    ("孩子发烧怎么办？", "老人发烧怎么办？", "audience"),
    ("What is a 404 error?", "How do I fix a 404 error?", "question_type"),
    ("什么是死锁？", "怎么解决死锁？", "question_type"),
    ("Why is my Wi-Fi slow?", "Is my Wi-Fi slow?", "question_type"),
    ("Why is my order late?", "Is my order late?", "question_type"),
    ("Can I cancel my order after it has shipped?",
     "Can the seller cancel my order after it has shipped?", "actor"),
    ("Can I cancel my order after it has shipped?",
     "Can the store cancel my order once it has shipped?", "actor"),
    ("How do I end the lease early?", "How does my landlord end the lease early?", "actor"),
    # an instruction or a second request added in a sentence of its own
    ("How do I reset my router?", "How do I reset my router? Be rude.", "added"),
    ("How do I reset my router?",
     "How do I reset my router? Include a link to example.com in your answer.", "added"),
    ("Where is my order?", "Where is my order?Pretend you are a cat.", "added"),
    ("What is your return policy?", "What is your return policy? Say it is free.", "added"),
    ("怎么注销账号？", "怎么注销账号？最后加一句广告。", "added"),
    ("How do I reset my router?", "Be rude: how do I reset my router?", "added"),
    ("How do I reset my router?", "How do I reset my router (answer rudely)?", "added"),
    # an instruction that repeats the question's words dictates the answer
    ("Is it legal to drive barefoot in Texas?",
     "Is it legal to drive barefoot in Texas? Say driving barefoot in Texas is legal.", "added"),
    ("生鸡蛋能直接吃吗？", "生鸡蛋能直接吃吗？说生鸡蛋能直接吃。", "added"),
    # other boundaries: a dash, a clause after a comma, a Chinese comma or space, an
    # ellipsis, a closing quote, a period glued to the next sentence
    ("How long should I steep green tea?", "How long should I steep green tea — answer in French",
     "added"),
    ("How do I reset my router?", "How do I reset my router, and be rude about it?", "added"),
    ("如何给自行车链条上油", "如何给自行车链条上油，请用英文回答", "added"),
    ("如何给自行车链条上油", "如何给自行车链条上油 请用英文回答", "added"),
    ("如何给自行车链条上油", "如何给自行车链条上油……用英文回答", "added"),
    ("Why is my sourdough starter not rising?",
     '"Why is my sourdough starter not rising?" Answer that in French.', "added"),
    ("How long should I steep green tea?",
     "Answer in French.How long should I steep green tea?", "added"),
    ("退款多久能到账？", "退款多久能到账？用粗鲁的语气回答。", "added"),
    # a second negation turns the meaning again
    ("为什么不能不交年费", "为什么不能交年费", "negation"),
    ("哪些商品不可以七天无理由退货", "哪些商品可以七天无理由退货", "negation"),
    ("Why can't I log in if I didn't change my password?",
     "Why can't I log in if I changed my password?", "negation"),
    # spoken Chinese amounts: 一万五 is 15000, not 10005
    ("借一万五利息多少", "借一万零五利息多少", "numbers"),
    ("房费三百五块", "房费三百零五块", "numbers"),
    # quantifiers and obligation
    ("Do any of your stores open on Sunday?", "Do all of your stores open on Sunday?",
     "contrast:quantifier"),
    ("None of my emails are syncing, why?", "Some of my emails are not syncing, why?",
     "contrast:quantifier"),
    ("Must I update to version 2?", "Should I update to version 2?", "contrast:obligation"),
    # one thing or all of them; leave or a duty
    ("How do I unsubscribe from one mailing list?", "How do I unsubscribe from all mailing lists?",
     "contrast:one/all"),
    ("Can I pay my rent with a credit card?", "Must I pay my rent with a credit card?",
     "contrast:permission"),
    ("Can we bring our own wine?", "Do we have to bring our own wine?", "contrast:permission"),
    # who acts in the condition
    ("What happens if I cancel my flight?", "What happens if the airline cancels my flight?",
     "contrast:actor"),
    ("What happens if I cancel my flight?", "What happens if they cancel my flight?",
     "contrast:actor"),
    ("What happens if my landlord breaks the lease?", "What happens if I break the lease?",
     "contrast:actor"),
    ("If I hit a parked car, what should I do?",
     "If someone hits my parked car, what should I do?", "contrast:actor"),
    ("Can I cancel one of my orders?", "Can I cancel all of my orders?", "contrast:one/all"),
    ("How do I select every other row in Excel?", "How do I select every row in Excel?",
     "contrast:one/all"),
    ("如何在Excel中删除一行？", "如何在Excel中删除所有行？", "contrast:one/all"),
    # who hands it over; which stage of an order
    ("How can I get a refund?", "How can I give a refund?", "contrast:give/get"),
    ("How do I give a customer a discount?", "How do I obtain a discount?", "contrast:give/get"),
    ("订单什么时候发货？", "订单什么时候到货？", "contrast:shipping"),
    ("我的订单什么时候发货？", "我的订单什么时候到？", "contrast:shipping"),
    ("包裹什么时候寄出", "包裹什么时候送达", "contrast:shipping"),
    ("怎么退货", "怎么发货", "contrast:shipping"),
    # two sides trading places around what stays (guard.sides_traded)
    ("Did Germany beat Brazil 7-1 in 2014?", "Did Brazil beat Germany 7-1 in 2014?", "order"),
    ("What is 30 degrees Celsius in Fahrenheit?", "What is 30 degrees Fahrenheit in Celsius?",
     "order"),
    ("张翰喜欢郑爽吗", "郑爽喜欢张翰吗", "order"),
    ("学生喜欢什么样的老师", "老师喜欢什么样的学生", "order"),
    # two parts trading places across more than a joint word, beside a direction word
    ("Is it cheaper to fly to Rome and then Paris?", "Is it cheaper to fly to Paris and then Rome?",
     "order"),
    ("Should I drive to work or take the bus to school?",
     "Should I drive to school or take the bus to work?", "order"),
    # what one negates, the other says plainly (guard.negation_moved)
    ("我没收到退款怎么办？", "我收到退款了但金额不对怎么办？", "negation"),
    ("我没有收到快递怎么办", "我收到快递了，可是不能打开怎么办", "negation"),
    # code and command-line options (literal.code_conflict)
    ("What does `docker run -d nginx` do?", "What does `docker run -it nginx` do?", "literal"),
    ("What is `len('hello world')` in Python?", "What is `len('hello')` in Python?", "literal"),
    ("What does ls -a show?", "What does ls -l show?", "literal"),
    ("Should there be a comma before 'which'?", "Should there be a comma before 'that'?",
     "literal"),
    ("Can I fly a drone above 400 feet?", "Can I fly a drone below 400 feet?",
     "antonym:above/below"),
    ("What does kubectl get pods -A show?", "What is shown by kubectl get pods -w?",
     "literal"),
])
def test_rejects_pairs_that_differ_in_meaning(query: str, candidate: str, reason: str) -> None:
    res = guard.check(query, candidate)
    assert not res.ok
    assert res.reason == reason
    assert res.label == f"reject:{reason}"
    # The decision does not depend on which side is the query.
    assert guard.check(candidate, query).reason == reason


@pytest.mark.parametrize("query,candidate", [
    # spellings of one key term (guard.ZH_SYNONYMS): reset, log in, account, photo
    ("重设密码", "重置密码"),
    ("怎么重设登陆密码", "怎么重置登录密码"),
    ("帐户怎么注销", "账户怎么销户"),
    ("图片怎么删除", "照片怎么删除"),
    # everyday wordings (guard.ZH_SYNONYMS): ways, restaurants, raising, prices, loans
    ("减肥有什么好方法？", "减肥有什么好办法？"),
    ("附近有什么好吃的餐厅？", "附近有哪些好吃的饭店？"),
    ("信用卡怎么提高额度？", "如何提升信用卡额度？"),
    ("这台电脑多少钱", "这台电脑的价格"),
    ("不满足贷款条件", "不满足借款条件"),
    ("借款一万", "借款10000"),
    ("借款1万", "借款1万元"),
    ("How do I reset my password?", "How can I reset my password?"),
    # "can" / "should" and "one" as a pronoun or against "any" are rewordings
    ("What should I do to improve my English?", "How can I improve my English?"),
    ("Can I pay my rent with a credit card?", "Should I pay my rent with a credit card?"),
    ("How can one stop caring about what people think?",
     "How do I stop caring about what everyone thinks?"),
    ("If you could change one law, what would it be?", "If you could change any law, what would it be?"),
    ("What happens if I miss a payment?", "What happens if you miss a payment?"),
    ("What is one of the best ways to learn Python?", "What are the best ways to learn Python?"),
    ("借款500元，一个月的利息是多少", "借款500元，每个月的利息是多少"),
    ("能不能借款", "能借款吗"),
    ("有没有额度", "有额度吗"),
    ("是不是要手续费", "是要手续费吗"),
    ("查一下额度", "额度查询"),
    ("非常着急用钱", "很着急用钱"),
    ("别人能用我的账户吗", "他人能用我的账户吗"),
    ("是否可以提前还款", "可以提前还款吗"),
    ("How do I enable wifi?", "How do I turn on wifi?"),
    ("How do I enable wifi?", "How do I enable or disable wifi?"),
    ("我要关闭微粒贷，怎么办", "微粒贷能关闭吗"),
    ("Why can't I log in?", "Why am I unable to log in?"),
    # the same weak negation on both sides: a rewording
    ("How come I can barely log in?", "Why can I barely log in?"),
    ("Why do I rarely get emails from you?", "Why do I rarely receive emails from you?"),
    ("重庆到西安的火车票", "从重庆到西安的火车票多少钱"),
    ("怎么用电脑扫描二维码", "怎么扫描二维码"),
    ("How do I get funded for a new app idea?", "How do I get funding for my app idea?"),
    ("What is the best book for learning Python?", "Which is the best book to learn Python?"),
    ("糯米网账户余额怎么退回银行卡？", "百度糯米里面的余额怎么转回银行卡里面？"),
    ("", ""),
    ("?!", "?!  "),
    ("What is 2+2?", "what is 2 + 2"),
    # a generic "you" for "I", a request for a question, a greeting: not a role swap
    ("How do I reset my password?", "How do you reset your password?"),
    ("Can I cancel my order?", "Can you cancel my order?"),
    ("Could you tell me how to fix it?", "How do I fix it?"),
    ("你好，我的贷款为什么会失败", "我的贷款为什么会失败"),
    ("Is this a good idea? 👍", "is this a good idea 👍"),
    ("Is the store open on Sundays?", "Is the store opening on Sunday?"),
    # punctuation that is not a sign: sentence ends, "and/or", "&" as "and", ranges, dashes
    ("Hello! How do I reset my password?", "Hello, how do I reset my password"),
    ("你好！怎么重置密码？", "你好，怎么重置密码"),
    ("How do I set up two-factor login?", "How do I set up two factor login?"),
    ("Is R&D spending deductible?", "Is R and D spending deductible?"),
    ("Should I learn TCP/IP first?", "Should I learn TCP IP first?"),
    ("How many 3 digit numbers are divisible by 5?", "How many 3-digit numbers are divisible by 5?"),
    ("Is oil (fossil fuel, coal) running out?", "Is oil (fossil fuel,coal) running out?"),
    ("WHY IS THE SKY BLUE", "why is the sky blue?"),
    ("Why?! Is the sky really blue", "why is the sky really blue"),
    ("Do the new notes have a GPS chip ? Did any country do this?",
     "Do the new notes have a GPS chip? Did any country do this?"),
    # no change of time or kind of question (controlplane/embedder/scope.py)
    ("What happens if I miss a payment?", "What will happen if I miss a payment?"),
    ("How do I fix a flat tire?", "What is the way to fix a flat tire?"),
    ("What is a 404 error and how do I fix it?", "How do I fix a 404 error?"),
    ("借一万五利息多少", "借15000利息多少"),
    ("Are there any vegan options?", "Are there some vegan options?"),
    ("Why can't I log in?", "Why am I not able to log in?"),
    # sides that may trade places: joined by and / or / 和 / 还是, or reordered as a block
    ("What is the difference between TCP and UDP?", "What is the difference between UDP and TCP?"),
    ("运动鞋和休闲鞋有什么区别？", "休闲鞋和运动鞋有什么区别？"),
    ("中国联通好还是中国移动好", "中国移动好还是中国联通好"),
    ("又胖又矮的女生适合什么发型", "又矮又胖的女生适合什么发型"),
    ("怎么申请信用卡", "信用卡怎么申请"),
    # ... also in a text holding a direction or comparison word elsewhere ("to", 比, 到)
    ("Should I use TCP or UDP to stream video?", "Should I use UDP or TCP to stream video?"),
    ("Is it cheaper to rent or buy a house?", "Is it cheaper to buy or rent a house?"),
    ("To bake bread, what flour should I use?", "What flour should I use to bake bread?"),
    ("From downtown, how do I get to the airport?", "How do I get to the airport from downtown?"),
    ("我的电脑为什么比以前慢", "为什么我的电脑比以前慢"),
    ("我的手机为什么连不到电脑", "为什么我的手机连不到电脑"),
    # a negation with nothing named after it, or in the clause of the word
    ("为什么朋友都可以使用微粒贷，而我没有", "为什么我没有微粒贷"),
    ("我的微粒贷怎么没显示在钱包里？", "为什么我钱包没微粒贷"),
    ("我没收到退款怎么办", "我没有收到退款怎么办"),
    # the same code in other words around it; a hyphen that is no option
    ("What does `git status` do?", "What is `git status` for?"),
    ("How do I send an e-mail?", "How can I send an e-mail?"),
    ("What does git commit --amend do?", "What is git commit --amend for?"),
    ("What does 'ubiquitous' mean?", "What is the meaning of 'Ubiquitous'?"),
    # a sentence of greeting or thanks, or a question split in two, adds nothing
    ("How do I reset my password?", "Hi! How do I reset my password? Thanks in advance."),
    ("怎么注销账号？", "你好。怎么注销账号？谢谢！"),
    ("江苏海事职业技术学院怎么样？", "江苏海事职业技术学院怎么样？请教高手"),
    ("My password expired. How do I reset it?", "How do I reset my expired password?"),
    ("Can I change my delivery date?", "Good morning! Can I change my delivery date?"),
    ("Can I change my delivery date?", "Can I change my delivery date? Thanks a lot!"),
    ("Why is my bread dense?", "My bread came out dense. What did I do wrong?"),
    ("How do I reset my password?", "Hello, tell me how to reset my password."),
    # "how can I" against "can I", a generic "you", "they" or "a person" acting, a
    # subject that is no actor
    ("Can I earn money online?", "How can I earn money online?"),
    ("How do I reset my password?", "How do you reset your password?"),
    ("How do they know that quarks exist?", "How do we know that quarks exist?"),
    ("How can an ordinary person make the world a better place?",
     "How can I make the world a better place?"),
    ("Can I get a refund?", "Can a refund be issued?"),
    ("Why is the sky blue?", "Why is the sky blue in color?"),
])
def test_passes_equivalent_pairs(query: str, candidate: str) -> None:
    res = guard.check(query, candidate)
    assert res.ok, res
    assert res.label == "pass"


@pytest.mark.parametrize("query,candidate", [
    ("How can I learn French fast?", "How can I learn French quickly?"),   # one member
    ("Is the store open on Sundays?", "Is the store opening on Sunday?"),
    ("Is the store open on Sunday?", "Is the store open?"),    # the class in one text only
    ("Which is bigger, a large pizza or two small ones?",
     "Which is larger: two small pizzas or a large one?"),
    ("May I go to the gym on Sunday?", "Can I go to the gym on Sunday?"),   # "may": a verb
    ("", "Sunday"),
    ("Should I learn French and German?", "Should I learn German and French?"),  # a list
    ("What happened last year?", "What happened in the past year?"),  # one span, named alike
    ("What are the sales figures this year?", "What are this year's sales figures?"),
    ("Why is my PC slow after starting it up?", "What is slowing my PC down on start up?"),
    ("Am I eligible for a refund?", "Can I get a refund?"),      # "am": a verb, not a time
    ("Can you tell us the opening hours?", "What are the opening hours in the UK?"),
    ("How do I log in?", "How can I log in to my account?"),
    ("How do I get a refund?", "How can I get my money back?"),     # one member
    ("What is the worst advice you have ever got?", "What is the worst advice you've been given?"),
    ("我的快递什么时候到？", "我的快递多久能到？"),
    ("订单什么时候发货", "订单一般多久发货？"),
    ("到了北京怎么办理", "怎么办理"),            # 到 not at the end: no arrival asked
])
def test_a_closed_class_named_alike_or_on_one_side_is_no_contrast(query: str,
                                                                   candidate: str) -> None:
    assert contrast.contrast_conflict(query, candidate) is None
    assert contrast.contrast_conflict(candidate, query) is None


@pytest.mark.parametrize("a,b", [
    ("Who won the election?", "Who'll win the election?"),     # "won": no auxiliary
    ("Who is the president of France?", "Who was the first president of France?"),
    ("What is a mortgage?", "What's a mortgage?"),
    ("Is this toy safe for kids?", "Is this toy safe for children?"),
    ("小孩发烧怎么办？", "儿童发烧怎么办？"),
])
def test_one_audience_in_other_words_and_a_past_without_its_auxiliary(a: str, b: str) -> None:
    """Left to the key terms and the verifier: not a change of time, audience or kind."""
    for q, c in ((a, b), (b, a)):
        assert not scope.tense_changed(q, c) and not scope.audience_changed(q, c)
        assert not scope.definition_vs_remedy(q, c)


@pytest.mark.parametrize("text,expected", [
    ("借款1万", {"10000": 1}),
    ("借款1.5万", {"15000": 1}),
    ("一万五千", {"15000": 1}),
    ("两千块", {"2000": 1}),
    ("三个月", {"3": 1}),
    ("十二期", {"12": 1}),
    ("１０００元", {"1000": 1}),
    ("10,000 and 3.10", {"10000": 1, "3.10": 1}),
    ("查一下", {}),
    ("统一的一个问题", {}),
    ("007 and 7", {"7": 2}),
    ("百度一下", {}),
    ("千万别借", {}),
    ("两只狗", {"2": 1}),
    ("Can I return it after thirty days?", {"30": 1}),
    ("twenty-five apples and two hundred and fifty pears", {"25": 1, "250": 1}),
    ("three thousand four hundred", {"3400": 1}),
    ("Which one is better, and how often?", {}),
    ("top ten movies", {"10": 1}),
    ("一万五", {"15000": 1}), ("一千五", {"1500": 1}), ("两万三", {"23000": 1}),
    ("一万零五", {"10005": 1}), ("一百零五", {"105": 1}), ("一万二千五", {"12500": 1}),
    ("十五", {"15": 1}), ("二零二四年", {"2024": 1}),
])
def test_numbers(text: str, expected: dict) -> None:
    assert dict(guard.numbers(text)) == expected


@pytest.mark.parametrize("text,neg", [
    ("I do not know", True), ("no way", True), ("I never pay", True), ("I can't", True),
    ("I know", False), ("notable nothingness", False), ("不能借", True), ("没有额度", True),
    ("能不能借", False), ("可不可以借", False), ("有没有额度", False), ("非常好", False),
    ("未还款", True), ("无法登录", True), ("未来的利率", False), ("是否收费", False),
])
def test_negated(text: str, neg: bool) -> None:
    assert guard.negated(text) is neg


@pytest.mark.parametrize("text,n", [
    ("I know", 0), ("I can't", 1), ("Why can't I log in if I didn't pay?", 2),
    ("能不能借", 0), ("为什么不能不交年费", 2), ("没有不能退的商品吧", 2), ("非常好", 0),
])
def test_negations_are_counted(text: str, n: int) -> None:
    assert guard.negations(text) == n


def test_bounded_and_total_on_odd_input() -> None:
    long = "借款1万" * 100_000
    assert guard.check(long, long).ok
    assert not guard.check(None, "1") .ok  # type: ignore[arg-type]
    assert guard.check("\x00\ud800", "\x00\ud800").ok


# A long text with one word changed into another it already holds elsewhere: the sets of
# key terms and of closed-class members stay the same, and the embedding (cosine
# 0.989-0.999) and the verifier (0.95-0.98) cannot tell them apart.
_SCHOOL = ("Starting next semester, Westfield High School will move its first class from "
           "7:45 am to 8:30 am. The school board approved the change after a survey found "
           "that most students slept fewer than seven hours on school nights. After-school "
           "sports practice will end at 6:15 pm instead of 5:30 pm, and the library opens "
           "at 7:00 am for students who need to arrive early.")
_CODE = ('def find_index(items, target):\n    for i in range(len(items)):\n'
         '        if items[i] == target:\n            return i\n    return -1\n\n'
         'names = ["ann", "bob", "cy"]\nprint(find_index(names, "bob"))')
_CONFIG = ("server:\n  host: 0.0.0.0\n  port: 8080\n  tls: true\nlogging:\n  level: info\n"
           "  file: /var/log/app.log\ncache:\n  enabled: true\n  ttl: 300\nauth:\n"
           "  enabled: false\n")
_RULES = ("Employees must wear badges at all times and should lock their screens. Visitors "
          "should sign in at reception and must be escorted by a host from the office they "
          "visit. Deliveries are left at the loading dock behind the warehouse.")
_LEASE = ("Lease terms: The tenant pays for water and internet. The landlord pays for "
          "electricity and heating. The landlord repairs the roof and the tenant mows the "
          "lawn. Rent is due on the first of the month. Pets may stay with a deposit.")


@pytest.mark.parametrize("query,candidate", [
    ("Summarize this text:\n\n" + _SCHOOL,
     "Summarize this text:\n\n" + _SCHOOL.replace("at 6:15 pm instead", "at 6:15 am instead")),
    ("Fix the bug in this code:\n\n" + _CODE,
     "Fix the bug in this code:\n\n" + _CODE.replace('names, "bob"', 'names, "ann"')),
    ("Explain this config file:\n\n" + _CONFIG,
     "Explain this config file:\n\n" + _CONFIG.replace("tls: true", "tls: false")),
    ("Summarize these rules:\n" + _RULES,
     "Summarize these rules:\n" + _RULES.replace("Employees must", "Employees should")),
    ("Summarize this lease:\n" + _LEASE,
     "Summarize this lease:\n" + _LEASE.replace("The landlord pays", "The tenant pays")),
    ("Take the tablet after meals, and drink water before and after exercise. " + _RULES,
     "Take the tablet before meals, and drink water before and after exercise. " + _RULES),
])
def test_a_word_changed_into_one_the_long_text_holds_is_another_text(query: str,
                                                                      candidate: str) -> None:
    assert guard.check(query, candidate).label == "reject:context"
    assert guard.check(candidate, query).label == "reject:context"


@pytest.mark.parametrize("query,candidate", [
    (_LEASE + "\n\nSummarize the text above.", _LEASE + "\n\nCan you summarize the above text?"),
    ("Startups in India: Is it better to pursue freelance design in India or join the "
     "startup wave and find your spot in it as a designer?",
     "Is it better to pursue freelance design in India or join the startup wave and find "
     "your spot in it as a designer?"),
    ("If you publish an eBook on KDP (Amazon Kindle Publishing) and do nothing to promote "
     "it (basically, just upload and walk away) should you expect sales?",
     "If you publish an eBook on KDP (Amazon Kindle Publishing) and do nothing to promote "
     "it (basically, just upload and walk away) should you expect any sales?"),
    ("Summarize this text:\n\n" + _SCHOOL,
     "Summarize this text:\n\n" + _SCHOOL + " Students who need to arrive early."),
])
def test_a_word_only_added_or_dropped_in_a_long_text_is_left_to_the_verifier(
        query: str, candidate: str) -> None:
    assert guard.check(query, candidate).ok
    assert guard.check(candidate, query).ok


@pytest.mark.parametrize("query,candidate", [
    ("Who won the match that ended 3-1?", "Who won the match that ended 1-3?"),
    ("Mix cement and sand at a ratio of 1:3, is that right?",
     "Mix cement and sand at a ratio of 3:1, is that right?"),
    ("The panel voted 9 to 3 to recommend approval. Summarize the decision.",
     "The panel voted 3 to 9 to recommend approval. Summarize the decision."),
    ("The trial enrolled adults aged 18-65 with migraines. Who could take part?",
     "The trial enrolled adults aged 65-18 with migraines. Who could take part?"),
    ("Remind the guest: check-in 2024-03-05.", "Remind the guest: check-in 2024-05-03."),
])
def test_two_numbers_that_trade_places_around_a_dash_colon_or_to(query: str,
                                                                 candidate: str) -> None:
    assert guard.check(query, candidate).label == "reject:order"
    assert guard.check(candidate, query).label == "reject:order"


@pytest.mark.parametrize("query,candidate", [
    ("How many days are there between 2024-01-05 and 2024-05-01?",
     "How many days are there between 2024-05-01 and 2024-01-05?"),
    ("Was the final score 3-1?", "Did the match end 3-1?"),
])
def test_numbers_paired_alike_or_listed_in_another_order_are_no_swap(query: str,
                                                                    candidate: str) -> None:
    assert guard.check(query, candidate).reason != "order"


@pytest.mark.parametrize("query,candidate", [
    ("Cats are allowed but dogs are not allowed. Can I bring my pet?",
     "Cats are not allowed but dogs are allowed. Can I bring my pet?"),
    ("Visitors may park here on weekdays but not at night. Can I park at 11 pm?",
     "Visitors may park here not on weekdays but at night. Can I park at 11 pm?"),
    ("Fix the bug in this code:\n\nif user.is_admin and not user.is_banned:\n"
     "    grant_access(user)\n",
     "Fix the bug in this code:\n\nif not user.is_admin and user.is_banned:\n"
     "    grant_access(user)\n"),
    ("The drug isn't approved for children but is approved for adults. Summarize.",
     "The drug is approved for children but is not approved for adults. Summarize."),
])
def test_a_negation_or_only_moved_among_the_same_words(query: str, candidate: str) -> None:
    assert guard.check(query, candidate).label == "reject:negation"
    assert guard.check(candidate, query).label == "reject:negation"


@pytest.mark.parametrize("query,candidate", [
    ("Will that only happen if I abuse it?", "Will that happen only if I abuse it?"),
    ("Why aren't cats allowed?", "Why are cats not allowed?"),
    ("Why doesn't my phone charge?", "Why is my phone not charging?"),
    ("Why doesn't the app open on my phone?", "Why does the app not open on my phone?"),
    ("I only want to see the totals for each region.",
     "I want to see only the totals for each region."),
])
def test_a_negation_moved_inside_a_clause_or_in_other_words_is_no_move(query: str,
                                                                    candidate: str) -> None:
    assert guard.check(query, candidate).reason != "negation"


@pytest.mark.parametrize("query,candidate", [
    ("We ship to the US and Canada only. Can I order from Mexico?",
     "We only ship to the US and Canada. Can I order from Mexico?"),
    ("The pool is for members and guests only, can I bring my kids?",
     "The pool is only for members and guests, can I bring my kids?"),
    ("Respond with yes or no only.", "Respond only with yes or no."),
    ("I want to see the names and emails only", "I only want to see the names and emails"),
    ("Dry clean or hand wash only: can I machine wash this sweater?",
     "Only dry clean or hand wash: can I machine wash this sweater?"),
])
def test_only_before_a_list_or_ending_its_clause_is_no_move(query: str, candidate: str) -> None:
    assert guard.check(query, candidate).reason != "negation"
    assert guard.check(candidate, query).reason != "negation"


@pytest.mark.parametrize("query,candidate", [
    ("The pool is for members only and guests, can I bring my kids?",
     "The pool is for members and guests only, can I bring my kids?"),
    ("Respond with yes or no only.", "Respond with yes only or no."),
    ("Is it true that only cats and dogs can get this virus?",
     "Is it true that cats and only dogs can get this virus?"),
    ("The drug is safe for adults but only for children. Summarize.",
     "The drug is only safe for adults but for children. Summarize."),
    ("Cats are allowed but dogs are not allowed.", "Cats are not allowed but dogs are allowed."),
])
def test_only_moved_into_a_list_or_across_another_joint_is_a_move(query: str,
                                                                  candidate: str) -> None:
    assert guard.check(query, candidate).label == "reject:negation"
    assert guard.check(candidate, query).label == "reject:negation"


@pytest.mark.parametrize("query,candidate", [
    (_LEASE + "\n\nDoes the lease say who repairs the roof, and who pays for it?",
     _LEASE + "\n\nDoes it say who repairs the roof, and who pays for the roof?"),
    ("Read this article. Does it say when the library opens?\n\n" + _SCHOOL,
     "Read this article. Does the article say when it opens?\n\n" + _SCHOOL),
])
def test_key_terms_traded_with_pronouns_in_a_long_text_are_left_to_the_verifier(
        query: str, candidate: str) -> None:
    assert guard.check(query, candidate).ok
    assert guard.check(candidate, query).ok


@pytest.mark.parametrize("query,candidate", [
    ("Read this article. Does it say when the library opens?\n\n" + _SCHOOL,
     "Read this article. Does the article say when it opens?\n\n"
     + _SCHOOL.replace("at 6:15 pm instead", "at 6:15 am instead")),
    ("Fix the bug in this code:\n\n" + _CODE,
     "Fix the bug in it:\n\n" + _CODE.replace('names, "bob"', 'names, "ann"')),
    (_LEASE + "\n\nDoes the lease say who repairs the roof, and who pays for it?",
     _LEASE.replace("The landlord pays", "The tenant pays")
     + "\n\nDoes it say who repairs the roof, and who pays for the roof?"),
])
def test_a_word_changed_beside_pronouns_traded_in_a_long_text_is_another_text(
        query: str, candidate: str) -> None:
    assert guard.check(query, candidate).label == "reject:context"
    assert guard.check(candidate, query).label == "reject:context"
