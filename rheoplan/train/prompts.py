"""The prompt plan for self-distillation: thousands of diverse prompts, built by program.

Why programmatic: a draft head trained on a few hundred prompts overfits them (the first
shipped head: 72% top-1 on its training prompts, 36% held out). Diversity is cheap to
generate: topics x tasks x output formats for chat and instructions, languages x tasks x
extras for code, numeric word problems with seeded numbers for math, and several
rewriting tasks over the passages of ``prompts_train.txt`` for summarisation, plus the
shipped ``prompts_train.txt`` itself. A quarter of the first-turn conversations get a
multi-turn follow-up (``follow_up``): the target's own first answer, then a new user turn.

Evaluation prompts stay out: ``build_plan`` drops every generated prompt that equals or
near-duplicates a held-out prompt (``near_duplicate``), and the training tests check it.

The plan is deterministic in ``seed`` (``plan_digest`` fingerprints it; a tokens directory
records the digest so shards of different plans are never mixed).

Example:
    >>> plan = build_plan(n_generated=50, file_prompts=[("chat", "Hi!")], heldout=["Why is the sky blue?"])
    >>> len(plan), plan[0].source, plan[1].source
    (51, 'file', 'generated')
    >>> near_duplicate("Summarise: wind turbines turn the energy of moving air into power at sea.",
    ...                "Give a short summary: Wind turbines turn the energy of moving air into power at sea")
    True
    >>> near_duplicate("What is 31 times 7?", "What is 17 times 23?")
    False
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re
from dataclasses import dataclass

#: first id of follow-up prompts (``parent id + FOLLOWUP_BASE``)
FOLLOWUP_BASE = 1_000_000
#: one first-turn prompt in this many gets a follow-up turn
FOLLOWUP_EVERY = 4


@dataclass(frozen=True)
class PromptSpec:
    """One first-turn prompt of the plan."""

    id: int
    source: str  #: 'file' (prompts_train.txt), 'generated'
    category: str  #: chat, instructions, code, math, summarisation
    text: str


TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines", "the immune system",
    "climate change", "renewable energy", "solar panels", "nuclear fusion", "the stock market", "inflation",
    "compound interest", "budgeting", "credit scores", "remote work", "time management", "public speaking",
    "learning a new language", "meditation", "sleep hygiene", "running", "yoga", "strength training",
    "nutrition", "vegetarian cooking", "baking bread", "fermentation", "coffee brewing", "tea culture",
    "gardening", "composting", "beekeeping", "bird watching", "astronomy", "the Moon landing",
    "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution", "the printing press",
    "the French Revolution", "the Cold War", "the history of the internet", "democracy", "human rights",
    "recycling", "ocean pollution", "coral reefs", "rainforests", "deserts", "glaciers", "earthquakes",
    "hurricanes", "volcanoes", "dinosaurs", "evolution", "genetics", "DNA", "the human brain", "memory",
    "habits", "motivation", "creativity", "critical thinking", "philosophy", "ethics", "stoicism",
    "jazz music", "classical music", "learning the piano", "photography", "painting", "sculpture",
    "film making", "video games", "board games", "chess", "football", "basketball", "the Olympic Games",
    "cycling", "hiking", "camping", "travel on a budget", "city planning", "public transport", "architecture",
    "bridges", "electric motors", "batteries", "semiconductors", "quantum computing", "machine learning",
    "neural networks", "cybersecurity", "passwords", "encryption", "open source software", "databases",
    "cloud computing", "smartphones", "3D printing", "robots", "drones", "self-driving cars", "space travel",
    "Mars exploration", "satellites", "the periodic table", "chemical reactions", "magnetism", "electricity",
    "gravity", "the speed of light", "sound waves", "rainbows", "the seasons", "tides", "weather forecasting",
    "maps", "the history of writing", "libraries", "poetry", "Shakespeare", "mythology", "folk tales",
    "small business", "marketing", "negotiation", "job interviews", "teamwork", "leadership", "parenting",
    "friendship", "pets", "dog training", "cats", "horses", "bees", "ants", "octopuses", "whales",
    "sharks", "mushrooms", "trees", "flowers", "spices", "chocolate", "cheese making", "street food",
    "volunteering", "first aid", "fire safety", "personal finance", "minimalism", "home repairs",
    "woodworking", "knitting", "origami", "calligraphy", "the Olympic marathon", "mountaineering",
]

CHAT_TASKS = [
    "Explain {t} to a beginner.",
    "What is {t} and why does it matter?",
    "What are the most common misconceptions about {t}?",
    "Give me three practical tips about {t}.",
    "What are the pros and cons of {t}?",
    "How would you explain {t} to a ten-year-old?",
    "Write a short story in which {t} plays a central role.",
    "Write a short poem about {t}.",
    "Summarise the history of {t}.",
    "Compare {t} and {u}.",
    "What questions should I ask an expert on {t}?",
    "What is a surprising fact about {t}?",
    "Describe a typical day of someone whose job involves {t}.",
    "How is {t} likely to change in the next twenty years?",
    "Why do some people find {t} hard to understand?",
    "I want to get into {t}. Where should I start?",
    "Write a dialogue between a teacher and a student about {t}.",
    "What does {t} have to do with everyday life?",
]

INSTRUCTION_TASKS = [
    "Create a one-week study plan for {t}.",
    "Write a product description for an app about {t}.",
    "Write an email to a friend recommending that they learn about {t}.",
    "List five interesting facts about {t}.",
    "Write a quiz with three questions about {t}, with answers.",
    "Give me a checklist for someone starting with {t}.",
    "Write a short blog post introduction about {t}.",
    "Write a tweet announcing a workshop on {t}.",
    "Create a glossary of five key terms related to {t}.",
    "Outline a ten-minute presentation on {t}.",
]

FORMATS = [
    "", " Answer in one paragraph.", " Use a bulleted list.", " Keep it under 100 words.",
    " Use simple language.", " Format the answer as a numbered list.", " Include a concrete example.",
    " Answer in a friendly tone.", " Use a Markdown table.", " Start with a one-sentence summary.",
]

LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "C++", "TypeScript", "Bash"]

CODE_TASKS = [
    "reverses a string", "counts the vowels in a string", "returns the n-th Fibonacci number",
    "checks whether a number is prime", "computes the factorial of a number", "merges two sorted lists",
    "removes duplicates from a list while keeping the order", "finds the largest element of an array",
    "converts Celsius to Fahrenheit", "checks whether a string is a palindrome", "flattens a nested list",
    "computes the greatest common divisor of two integers", "counts the words in a sentence",
    "implements binary search", "sorts a list with insertion sort", "reads a text file and counts its lines",
    "capitalises the first letter of every word", "returns the sum of the digits of a number",
    "checks whether two strings are anagrams", "computes the average of a list of numbers",
    "finds the second smallest number in a list", "rotates an array by k positions",
    "converts a decimal number to binary", "validates a simple email address",
    "computes the running total of a list", "groups words by their first letter",
    "returns the most frequent element of a list", "transposes a matrix", "generates all subsets of a set",
    "implements a stack with push and pop", "parses a comma-separated line into fields",
    "computes the Levenshtein distance between two strings", "checks balanced parentheses",
]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "How would you write code in {lang} that {task}?",
    "Show me an idiomatic {lang} solution: a function that {task}.",
]

CODE_EXTRAS = ["", " Add comments.", " Include a short usage example.", " Explain the time complexity.",
               " Then explain how it works."]

CODE_CONCEPTS = [
    "recursion", "closures", "pointers", "garbage collection", "hash tables", "big-O notation", "unit tests",
    "version control with git", "REST APIs", "regular expressions", "object-oriented programming",
    "functional programming", "immutability", "concurrency", "deadlocks", "memory leaks", "type systems",
    "compilers and interpreters", "virtual environments", "dependency injection", "caching",
    "binary trees", "graphs", "dynamic programming", "exceptions", "async/await", "SQL joins",
    "database indexes", "JSON", "HTTP status codes",
]

CONCEPT_TEMPLATES = [
    "Explain {c} with a short code example.", "What are common mistakes beginners make with {c}?",
    "When should I use {c}, and when not?", "Explain {c} in {lang}.",
]

PASSAGE_TASKS = [
    "Summarise this text in one sentence: {p}", "List the key points of this text: {p}",
    "Write a title for this text: {p}", "Explain this text to a child: {p}",
    "Rewrite this text in simpler English: {p}", "What questions does this text leave open? {p}",
    "Turn this text into three quiz questions: {p}",
]

FOLLOW_UPS = [
    "Can you explain that more simply?", "Can you give me a concrete example?",
    "Summarise your answer in one sentence.", "What are common mistakes people make here?",
    "Can you put that in a bulleted list?", "Thanks! Can you say more about the first point?",
    "Is there anything important you left out?", "How would you explain this to a child?",
    "Can you make it shorter?", "What should I read or do next?", "Are you sure? Please double-check.",
    "Can you give me a different approach?",
]


def _math_problem(rnd: random.Random) -> str:
    a, b, c = rnd.randint(2, 99), rnd.randint(2, 99), rnd.randint(2, 400)
    name = rnd.choice(["Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gia", "Hugo", "Ines", "Jon", "Kemal", "Lea"])
    item = rnd.choice(["apples", "books", "marbles", "stamps", "pencils", "coins", "cards", "shells"])
    forms = [
        f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        f"{name} had {a + b} {item} and gave away {b}. How many are left?",
        f"A box holds {a} {item}. How many {item} are in {b} boxes?",
        f"{name} shares {a * b} {item} equally among {b} friends. How many does each friend get?",
        f"What is {a} times {b}?", f"What is {a * c} divided by {a}?", f"What is {c} plus {a} minus {b}?",
        f"What is {rnd.choice([5, 10, 15, 20, 25, 30, 40, 60, 75])} percent of {c}?",
        f"Solve for x: {a}x + {b} = {a * rnd.randint(1, 20) + b}.",
        f"A train travels {a * 10} km in {b % 9 + 1} hours. What is its average speed?",
        f"Find the area of a rectangle with sides {a} cm and {b} cm.",
        f"Find the perimeter of a square with side {a} m.",
        f"What is the circumference of a circle with radius {a}?",
        f"A shirt costs ${c} and is on sale for {rnd.choice([10, 20, 25, 30, 50])}% off. What is the sale price?",
        f"What is the mean of {a}, {b} and {c}?",
        f"How many minutes are there in {a} hours?",
        f"Convert {c} grams to kilograms.",
        f"If {name} saves ${a} every week, how much will {name} have after {b} weeks?",
        f"What is the next number in the sequence {a}, {a + b}, {a + 2 * b}, {a + 3 * b}?",
        f"Is {c} a prime number? Explain why.",
        f"What fraction of {a + b} is {a}? Simplify it.",
        f"A recipe needs {a % 7 + 2} eggs for {b % 5 + 2} people. How many eggs for {c % 20 + 4} people?",
    ]
    q = rnd.choice(forms)
    return q + rnd.choice(["", " Explain step by step.", " Show your work.", " Give only the answer.",
                           " Explain your reasoning briefly."])


_WORD = re.compile(r"[a-z0-9%]+")
_STOP = set("a an the of to in on and or for is are be with that this what how why do does i you me my "
            "your it its as by at from can about some".split())


def _norm(s: str) -> str:
    return " ".join(_WORD.findall(s.lower()))


def near_duplicate(a: str, b: str, *, jaccard: float = 0.6, contained: float = 0.8, ratio: float = 0.95) -> bool:
    """True when two prompts are equal or nearly so: Jaccard overlap of their content words
    (numbers included) ``>= jaccard``; or, when both have at least 6 content words, the
    share of the smaller set found in the other ``>= contained`` (the same passage under
    another instruction); or character-level similarity of their normalised text
    ``>= ratio`` (difflib).

    Why content words and not plain character similarity: training and held-out prompts
    share templates by design ("What is 31 times 7?" vs "What is 17 times 23?"); a prompt
    leaks the evaluation only when it carries the same content (same passage, same
    subject, same numbers), lightly edited or reordered.
    """
    na, nb = _norm(a), _norm(b)
    if na == nb:
        return True
    wa, wb = set(na.split()) - _STOP, set(nb.split()) - _STOP
    if wa and wb and len(wa & wb) / len(wa | wb) >= jaccard:
        return True
    if min(len(wa), len(wb)) >= 6 and len(wa & wb) / min(len(wa), len(wb)) >= contained:
        return True
    sm = difflib.SequenceMatcher(None, na, nb, autojunk=False)
    return sm.real_quick_ratio() >= ratio and sm.quick_ratio() >= ratio and sm.ratio() >= ratio


def passages(file_prompts: list[tuple[str, str]]) -> list[str]:
    """The distinct passages of the summarisation prompts (the text after the first ':' or '?')."""
    out = []
    for cat, p in file_prompts:
        if cat != "summarisation":
            continue
        m = re.search(r"[:?]\s+(.{80,})$", p, flags=re.S)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def build_plan(*, seed: int = 0, n_generated: int = 6000, file_prompts: list[tuple[str, str]] | None = None,
               heldout: list[str] = ()) -> list[PromptSpec]:
    """First-turn prompts: ``file_prompts`` (category, text) first, then ``n_generated``
    programmatic prompts (distinct, seeded); no prompt of either kind equal or near a
    ``heldout`` prompt (such file prompts are dropped; their ids stay unused).

    The generated mix: ~45% chat, ~15% instructions, ~20% code, ~15% math, the rest
    summarisation-style rewrites of the file's passages.
    """
    if n_generated < 0:
        raise ValueError(f"n_generated={n_generated}: allowed >= 0")
    rnd = random.Random(seed)
    file_prompts = list(file_prompts or [])
    held = list(heldout)
    texts = passages(file_prompts)

    def candidate() -> tuple[str, str]:
        x = rnd.random()
        if x < 0.45:
            t, u = rnd.sample(TOPICS, 2)
            return "chat", rnd.choice(CHAT_TASKS).format(t=t, u=u) + rnd.choice(FORMATS)
        if x < 0.60:
            return "instructions", rnd.choice(INSTRUCTION_TASKS).format(t=rnd.choice(TOPICS)) + rnd.choice(FORMATS)
        if x < 0.72:
            return "code", (rnd.choice(CODE_TEMPLATES).format(lang=rnd.choice(LANGUAGES), task=rnd.choice(CODE_TASKS))
                            + rnd.choice(CODE_EXTRAS))
        if x < 0.80:
            return "code", rnd.choice(CONCEPT_TEMPLATES).format(c=rnd.choice(CODE_CONCEPTS), lang=rnd.choice(LANGUAGES))
        if x < 0.95 or not texts:
            return "math", _math_problem(rnd)
        return "summarisation", rnd.choice(PASSAGE_TASKS).format(p=rnd.choice(texts))

    def near_heldout(text: str) -> bool:
        for h in held:
            if near_duplicate(text, h):
                return True
        return False

    plan = [PromptSpec(i, "file", c, t) for i, (c, t) in enumerate(file_prompts) if not near_heldout(t)]
    seen = {_norm(t) for _, t in file_prompts}
    tries, nid = 0, len(file_prompts)
    while nid < len(file_prompts) + n_generated:
        tries += 1
        if tries > 50 * (n_generated + 10):
            raise ValueError(f"n_generated={n_generated}: the templates give fewer distinct prompts; "
                             "allowed fewer")
        cat, text = candidate()
        key = _norm(text)
        if key in seen or near_heldout(text):
            continue
        seen.add(key)
        plan.append(PromptSpec(nid, "generated", cat, text))
        nid += 1
    return plan


def plan_digest(plan: list[PromptSpec]) -> str:
    """Fingerprint of a plan (ids, categories, texts): 16 hex digits."""
    h = hashlib.sha256()
    for p in plan:
        h.update(f"{p.id}\t{p.category}\t{p.text}\n".encode())
    return h.hexdigest()[:16]


def has_follow_up(prompt_id: int) -> bool:
    """Whether first-turn prompt ``prompt_id`` gets a follow-up turn (one in
    ``FOLLOWUP_EVERY``, by hash)."""
    return int(hashlib.sha256(str(prompt_id).encode()).hexdigest()[:8], 16) % FOLLOWUP_EVERY == 0


def follow_up(prompt_id: int) -> str:
    """The follow-up user turn for first-turn prompt ``prompt_id`` (fixed by hash)."""
    return FOLLOW_UPS[int(hashlib.sha256(f"f{prompt_id}".encode()).hexdigest()[:8], 16) % len(FOLLOW_UPS)]
