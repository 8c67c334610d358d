"""Prompts built from templates for training EAGLE heads (the "math" and "writing" sources of
`jeagle/train/sources.py`): grade-school math word problems with their computed answers, and long-form
writing requests. Endless generators, deterministic in their seed.

A math template is a problem text with numeric fields, each drawn from a range or a list, and the
answer as a function of them. A drawing is kept only when the answer is a positive whole number, so the
problems have clean answers without hand-tuned constraints. A follow-up turn ("Now suppose each pencil
costs $4 instead...") changes one field named by one of the template's clauses and recomputes.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

NAMES = ("Ava Ben Chloe Diego Emma Farah Gabriel Hana Ivan Jade Kofi Lena Mateo Nadia Omar Priya Quinn Rosa Sam "
         "Tariq Uma Victor Wen Yara Zoe Amir Bella Carlos Dina Eli Fatima Grace Hugo Isla Jonas Keiko Luis Maya "
         "Nikhil Olga").split()
ITEMS = ("notebooks", "pencils", "apples", "stickers", "marbles", "cupcakes", "books", "candles", "postcards",
         "oranges", "batteries", "plants", "cookies", "erasers", "balloons", "muffins", "bracelets", "seed packets",
         "jars of jam", "comic books")
THINGS = ("jacket", "bicycle", "lamp", "backpack", "guitar", "pair of boots", "printer", "desk chair", "tent",
          "camera", "microwave", "skateboard", "telescope", "sewing machine")


@dataclass(frozen=True)
class MathTemplate:
    name: str
    text: str  # str.format fields: name, name2, item, thing, and the numeric ones in `fields`
    answer: Callable[[SimpleNamespace], object]  # of Fractions; None, or not a positive whole number: redraw
    follow: tuple[str, ...]  # clauses naming one numeric field each, for a follow-up turn
    fields: dict  # numeric field -> (lo, hi) or (lo, hi, step) inclusive, or a list to choose from


def _t(name, text, answer, follow=(), **fields) -> MathTemplate:
    return MathTemplate(name, text, answer, tuple(follow), fields)


def _at_most(hi, x):
    return x if x <= hi else None


MATH_TEMPLATES = (
    _t("change", "{name} buys {k} {item} at ${price} each and pays with a ${bill} bill. How much change, in dollars, "
       "does {name} get back?", lambda v: v.bill - v.k * v.price,
       ["{name} buys {k} {item}", "each of the {item} costs ${price}"], k=(2, 9), price=(2, 12), bill=[20, 50, 100]),
    _t("unit-rate", "A pack of {k} {item} costs ${total}. At the same price per item, how many dollars would {m} "
       "{item} cost?", lambda v: v.total / v.k * v.m, ["you want {m} {item}"], k=(2, 8), total=(4, 60), m=(3, 30)),
    _t("ages-older", "{name} is {x} years older than {name2}. In {y} years, {name} will be {z} years old. How old is "
       "{name2} now?", lambda v: v.z - v.y - v.x, ["{name} is {x} years older than {name2}"],
       x=(2, 15), y=(2, 10), z=(20, 60)),
    _t("ages-times", "{name} is {m} times as old as {name2}, who is {x} years old. How old will {name} be in {y} "
       "years?", lambda v: v.m * v.x + v.y, ["{name2} is {x} years old"], m=(2, 4), x=(3, 15), y=(2, 12)),
    _t("fraction-left", "{name} has {total} {item} and gives {num}/{den} of them to {name2}. How many {item} does "
       "{name} have left?", lambda v: v.total - v.total * v.num / v.den, ["{name} starts with {total} {item}"],
       total=(12, 120), num=(1, 3), den=[3, 4, 5, 6, 8]),
    _t("discount", "A {thing} normally costs ${price}. During a sale it is {pct}% off. What is the sale price in "
       "dollars?", lambda v: v.price * (100 - v.pct) / 100, ["the discount is {pct}%", "the {thing} normally costs "
       "${price}"], price=(20, 400, 20), pct=(10, 50, 5)),
    _t("percent-of", "In a school of {total} students, {pct}% walk to school. How many students do not walk?",
       lambda v: v.total * (100 - v.pct) / 100, ["{pct}% of the students walk"], total=(200, 1200, 50),
       pct=(10, 90, 5)),
    _t("two-legs", "A train travels at {v} kilometers per hour for {t} hours and then at {w} kilometers per hour for "
       "{s} hours. How many kilometers does it travel in total?", lambda v: v.v * v.t + v.w * v.s,
       ["the second part of the trip lasts {s} hours", "the train's first speed is {v} kilometers per hour"],
       v=(40, 120, 5), t=(2, 6), w=(30, 90, 5), s=(1, 5)),
    _t("travel-time", "{name} cycles {d} kilometers at a steady {v} kilometers per hour. How many minutes does the "
       "ride take?", lambda v: v.d * 60 / v.v, ["the ride is {d} kilometers long"], d=(6, 60),
       v=[10, 12, 15, 18, 20, 24, 30]),
    _t("fence", "A rectangular garden is {l} meters long and {w} meters wide. Fencing costs ${c} per meter. How many "
       "dollars does it cost to fence the whole garden?", lambda v: 2 * (v.l + v.w) * v.c if v.w < v.l else None,
       ["the garden is {w} meters wide", "fencing costs ${c} per meter"], l=(5, 40), w=(3, 25), c=(2, 15)),
    _t("tiles", "A floor measures {l} feet by {w} feet. One box of tiles covers {a} square feet. How many boxes must "
       "{name} buy to cover the whole floor?", lambda v: math.ceil(v.l * v.w / v.a), ["one box covers {a} square feet"],
       l=(8, 30), w=(6, 20), a=[10, 12, 15, 20, 25]),
    _t("savings", "{name} has saved ${s} and puts aside ${w} every week. How many weeks will it take before {name} "
       "has enough to buy a {thing} that costs ${c}?", lambda v: math.ceil((v.c - v.s) / v.w),
       ["{name} saves ${w} every week"], s=(10, 80, 5), w=(5, 30, 5), c=(100, 400, 10)),
    _t("recipe", "A recipe that serves {k} people uses {g} grams of flour. How many grams of flour are needed to "
       "serve {m} people?", lambda v: v.g * v.m / v.k, ["you need to serve {m} people"], k=[2, 4, 6, 8],
       g=(150, 900, 50), m=(3, 24)),
    _t("work-rate", "{name} can pack {x} boxes an hour and {name2} can pack {y} boxes an hour. Working together, how "
       "many hours will they take to pack {z} boxes?", lambda v: v.z / (v.x + v.y),
       ["{name2} packs {y} boxes an hour"], x=(5, 30), y=(5, 30), z=(60, 600, 10)),
    _t("remainder", "{name} has {c} {item} to share equally among {k} friends, giving each friend as many as "
       "possible. How many {item} are left over?", lambda v: v.c % v.k, ["there are {k} friends"], c=(20, 150),
       k=(3, 12)),
    _t("bags", "{name} packs {c} {item} into bags of {k}. How many bags can {name} fill completely?",
       lambda v: v.c // v.k, ["each bag holds {k} {item}"], c=(20, 300), k=(3, 15)),
    _t("inventory", "A shop has {s} {item}. On Monday it sells {a}, on Tuesday a delivery brings {b} more, and on "
       "Wednesday it sells {c}. How many {item} does the shop have at the end of Wednesday?",
       lambda v: v.s - v.a + v.b - v.c if v.a < v.s else None,
       ["the delivery brings {b} {item}", "the shop sells {c} on Wednesday"], s=(40, 200), a=(10, 120),
       b=(20, 100), c=(10, 120)),
    _t("tip", "Dinner for {name} and three friends costs ${bill}. They leave a {pct}% tip. How many dollars do they "
       "pay in total, tip included?", lambda v: v.bill * (100 + v.pct) / 100, ["they leave a {pct}% tip"],
       bill=(40, 300, 20), pct=[10, 15, 20, 25]),
    _t("interest", "{name} deposits ${p} in an account that pays {r}% simple interest per year. How many dollars of "
       "interest does the account earn in {y} years?", lambda v: v.p * v.r * v.y / 100,
       ["the money stays in the account for {y} years", "the interest rate is {r}% per year"],
       p=(500, 5000, 100), r=(2, 8), y=(2, 6)),
    _t("overtime", "{name} earns ${w} an hour for the first 40 hours of a week and time and a half for every hour "
       "after that. How many dollars does {name} earn in a week of {h} hours?",
       lambda v: 40 * v.w + (v.h - 40) * v.w * 3 / 2, ["{name} works {h} hours"], w=(12, 40, 2), h=(42, 55)),
    _t("laps", "{name} runs {laps} laps of a {m}-meter track every day. How many kilometers does {name} run in {d} "
       "days?", lambda v: v.laps * v.m * v.d / 1000, ["{name} runs for {d} days"], laps=(4, 20),
       m=[200, 250, 400, 500], d=(5, 30)),
    _t("average", "{name} scored {a}, {b}, {c} and {e} on four tests. What score does {name} need on the fifth test "
       "to have an average of exactly {avg}?", lambda v: _at_most(100, 5 * v.avg - (v.a + v.b + v.c + v.e)),
       ["the target average is {avg}"], a=(60, 100), b=(60, 100), c=(60, 100), e=(60, 100), avg=(70, 95)),
    _t("bulk", "Store A sells {item} in packs of {k} for ${p} a pack. Store B sells them singly for ${q} each. How "
       "many dollars does {name} save by buying {packs} packs at store A instead of the same number of {item} at "
       "store B?",
       lambda v: v.packs * (v.k * v.q - v.p), ["{name} buys {packs} packs"], k=(3, 12), p=(5, 40), q=(1, 6),
       packs=(2, 8)),
    _t("ratio", "In a class the ratio of girls to boys is {a}:{b}. There are {t} students. How many girls are there?",
       lambda v: v.t * v.a / (v.a + v.b), ["there are {t} students"], a=(1, 5), b=(1, 5), t=(20, 60)),
    _t("meeting", "Two cyclists start {d} kilometers apart and ride toward each other, one at {v} kilometers per hour "
       "and the other at {w} kilometers per hour. After how many hours do they meet?", lambda v: v.d / (v.v + v.w),
       ["they start {d} kilometers apart"], d=(30, 300, 10), v=(10, 30), w=(10, 30)),
    _t("consecutive", "The sum of three consecutive whole numbers is {s}. What is the largest of the three numbers?",
       lambda v: v.s / 3 + 1, ["the sum is {s}"], s=(30, 600)),
    _t("reading", "A book has {b} pages. {name} reads {p} pages every day. How many pages are left to read after {d} "
       "days?", lambda v: v.b - v.p * v.d, ["{name} reads {p} pages a day"], b=(150, 600, 10), p=(10, 40), d=(3, 14)),
    _t("phone-plan", "A phone plan costs ${base} a month and includes {inc} GB of data; every extra GB costs ${x}. "
       "{name} used {u} GB this month. What is the bill in dollars?",
       lambda v: v.base + (v.u - v.inc) * v.x if v.u > v.inc else None, ["{name} used {u} GB"], base=(15, 60, 5),
       inc=(2, 20), x=(2, 10), u=(3, 40)),
)
FOLLOW_UPS = ("Now suppose {clause} instead. How does the answer change?",
              "What if {clause} instead? Work out the new answer.",
              "Suppose instead that {clause}. What is the answer now?")


@dataclass(frozen=True)
class MathProblem:
    template: str
    turns: tuple[str, ...]  # the problem, and possibly a follow-up changing one number
    answers: tuple[int, ...]  # one per turn
    values: dict  # the first turn's fields


def _draw(spec, rng: random.Random):
    if isinstance(spec, list):
        return Fraction(rng.choice(spec))
    lo, hi, *step = spec
    return Fraction(rng.randrange(lo, hi + 1, *step))


def math_answer(t: MathTemplate, values: dict) -> int | None:
    """The template's answer for these values: a positive whole number, else None."""
    try:
        a = t.answer(SimpleNamespace(**values))
    except ZeroDivisionError:
        return None
    return int(a) if a is not None and a == int(a) and a > 0 else None


def math_problems(seed: int = 0, follow_up: float = 0.25) -> Iterator[MathProblem]:
    """Endless word problems from `MATH_TEMPLATES`, a template at random each; with probability
    `follow_up` a second turn changes one number (the answer to it recomputed, and different)."""
    rng = random.Random(f"math-{seed}")
    while True:
        t, answer = rng.choice(MATH_TEMPLATES), None
        while answer is None:  # redraw the numbers, keeping the template: every template equally often
            name, name2 = rng.sample(NAMES, 2)
            values = {"name": name, "name2": name2, "item": rng.choice(ITEMS), "thing": rng.choice(THINGS)}
            values |= {k: _draw(spec, rng) for k, spec in t.fields.items()}
            answer = math_answer(t, values)
        turns, answers = [t.text.format(**values)], [answer]
        if t.follow and rng.random() < follow_up:
            clause = rng.choice(t.follow)
            field = next(f for _, f, _, _ in string.Formatter().parse(clause) if f in t.fields)
            for _ in range(10):
                changed = values | {field: _draw(t.fields[field], rng)}
                new = math_answer(t, changed)
                if changed[field] != values[field] and new is not None and new != answer:
                    turns.append(rng.choice(FOLLOW_UPS).format(clause=clause.format(**changed)))
                    answers.append(new)
                    break
        yield MathProblem(t.name, tuple(turns), tuple(answers), values)


# Writing: (request with {topic}, length unit, shortest, longest).
WRITING_FORMS = (
    ("an essay on {topic}", "words", 400, 1000),
    ("a blog post about {topic}", "words", 300, 900),
    ("a short story that involves {topic}", "words", 400, 1000),
    ("a speech about {topic}", "words", 300, 800),
    ("a cover letter for a job at an organisation working on {topic}", "words", 300, 500),
    ("a product description for a new book about {topic}", "words", 300, 500),
    ("a report on {topic}", "words", 500, 1000),
    ("an op-ed arguing a position on {topic}", "words", 400, 900),
    ("a poem about {topic}", "lines", 12, 40),
    ("a dialogue between two friends who disagree about {topic}", "words", 300, 800),
    ("a beginner's how-to guide related to {topic}", "words", 400, 1000),
    ("a newsletter for a community group interested in {topic}", "words", 300, 700),
    ("a review of a documentary about {topic}", "words", 300, 800),
    ("a letter to the editor of a local newspaper about {topic}", "words", 300, 600),
    ("a lesson plan for teaching {topic}", "words", 400, 900),
    ("a press release announcing a project on {topic}", "words", 300, 600),
    ("a personal reflection on {topic}", "words", 300, 800),
    ("an FAQ page about {topic}", "words", 400, 900),
)
WRITING_TOPICS = tuple(t.strip() for t in """
remote work and city life; the history of the printing press; urban beekeeping; learning a second language as an adult;
the ethics of self-driving cars; community gardens; the science of sleep; why bridges fail; running a small bakery;
minimalism at home; the future of public libraries; living near a volcano; the life cycle of honeybees;
saving money on groceries; the invention of the telephone; working night shifts; rising seas and coastal towns;
the revival of board games; how vaccines are developed; the last lighthouse keepers; the Silk Road;
electric buses in small cities; homeschooling; the psychology of habits; recycling plastics; the first moon landing;
volunteering at an animal shelter; open-source software; the Great Barrier Reef; coffee farming; chess for children;
the four-day work week; social media and teenagers; jazz in the 1920s; wildfire prevention; tiny houses;
the microbiome; space tourism; the decline of handwriting; clean drinking water; caring for aging parents;
the history of vaccines; street food around the world; noise pollution; the Roman aqueducts; composting;
the gig economy; medieval castles; artificial intelligence in hospitals; birdwatching; the rise of e-sports;
the Dust Bowl; mentoring new employees; desert ecosystems; public speaking anxiety; the history of chocolate;
3D printing; the Antarctic Treaty; learning to swim as an adult; night skies and light pollution; bicycle commuting;
the invention of paper money; mountain rescue teams; rewilding farmland; the ethics of zoos; quantum computing;
school uniforms; the history of the bicycle; food waste in restaurants; vertical farming; the Apollo 13 mission;
the joy of baking bread; polar bears and sea ice; the economics of streaming music; the Great Fire of London;
sign language; ocean plastic; the first year of university; the history of maps; electric cars in winter;
the art of letter writing; migrating whales; small-town newspapers; the history of the Olympic Games;
mindfulness at work; the printing of banknotes; the discovery of penicillin; cybersecurity for small businesses;
the gold rush; knitting as a hobby; how earthquakes are measured; children's reading habits; the history of tea;
high-speed rail; the importance of wetlands; career changes after forty; ancient Egyptian medicine; lab-grown meat;
the psychology of color; the history of photography; dark-sky reserves; the role of museums; fast fashion;
the Wright brothers; refugees and resettlement; a village without cars; the science of rainbows; insect farming;
the history of the internet; solar panels on schools; the ethics of gene editing; long-distance friendships;
coral bleaching; the life of Marie Curie; traditional crafts; winter cycling; the rise of audiobooks;
the history of the piano; a water shortage; robots in warehouses; the first vaccine trials; camping with children;
the Hanseatic League; local elections; the history of soap; emergency preparedness; the language of bees;
digital privacy; the lost city of Pompeii; pet adoption; sustainable fishing; the history of clocks;
the benefits of walking; online learning; the building of the Panama Canal; urban trees; retirement planning;
the science of hurricanes; street art; the history of sugar; the return of wolves; video games and learning;
the invention of the compass; the gut-brain connection; repair cafes; a year without social media;
the history of libraries; glaciers; running a marathon; the origins of democracy; food allergies in schools;
the Voyager probes; mushrooms and forests; wind farms at sea; the history of typewriters; public transport at night;
kindness between strangers; the ethics of advertising to children; the Little Ice Age; moving to a new country
""".split(";"))
AUDIENCES = ("for high-school students", "for busy parents", "for retirees", "for small-business owners",
             "for a general audience", "for software engineers", "for people new to the subject",
             "for children aged 10",
             "for university students", "for local council members", "for nurses", "for a book club")
TONES = ("Keep the tone warm and conversational.", "Use a formal, authoritative tone.", "Make it light and humorous.",
         "Write in a calm, reflective voice.", "Be persuasive but fair to the other side.",
         "Keep it upbeat and encouraging.", "Use vivid, concrete imagery.", "Write plainly, avoiding jargon.")
STRUCTURES = ("Organise it in three sections with headings.", "Start with a short anecdote.",
              "End with a clear call to action.", "Include at least two concrete examples.",
              "Use short paragraphs and a bulleted list of key points.", "Give it a title.",
              "Close with a question for the reader.", "Open with a surprising fact.",
              "Include a brief counterargument and answer it.", "Finish with a one-sentence summary.")
OPENERS = ("Write", "Please write", "Compose", "Draft", "I need you to write", "Create")


def writing_prompts(seed: int = 0) -> Iterator[str]:
    """Endless long-form writing requests: a form and a topic, a length, maybe an audience, a tone and a
    structure (forms x topics x constraints: hundreds of thousands of combinations)."""
    rng = random.Random(f"writing-{seed}")
    while True:
        form, unit, lo, hi = rng.choice(WRITING_FORMS)
        text = f"{rng.choice(OPENERS)} {form.format(topic=rng.choice(WRITING_TOPICS))}"
        if rng.random() < 0.6:
            text += f" {rng.choice(AUDIENCES)}"
        n = rng.randrange(lo, hi + 1, 50 if unit == "words" else 4)
        text += rng.choice((f", about {n} {unit} long.", f". Aim for roughly {n} {unit}.", f" in about {n} {unit}."))
        tone = [rng.choice(TONES)] if rng.random() < 0.6 else []
        yield " ".join([text, *tone, *rng.sample(STRUCTURES, rng.choice((0, 1, 2)))])
