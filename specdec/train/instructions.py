"""Self-distillation prompts for a chat target (``data.corpus=instructions``): task templates x topics.

A chat model drafts for its own answers to user requests, so its drafter trains on
those answers. The requests here are built from task templates (explain, list,
write, compare, translate, summarise, solve, answer…: the kinds of turn a chat
benchmark asks, but none of its questions) crossed with topics and small numbers,
picked by a seeded generator: :func:`instructions` is a pure function of
``(n, seed)``. Each is rendered through the target's chat template as one user turn;
the target's greedy answer to it is the training text (:mod:`specdec.train.data`).
"""

from __future__ import annotations

import random

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the immune system", "climate change",
    "the French Revolution", "the Roman Empire", "the printing press", "the Silk Road", "ancient Egypt",
    "machine learning", "the internet", "electric cars", "solar energy", "recycling", "vaccines",
    "the stock market", "inflation", "supply and demand", "remote work", "social media", "sleep",
    "healthy eating", "running a marathon", "learning a language", "playing the guitar", "chess",
    "gardening", "baking bread", "coffee", "honeybees", "whales", "rainforests", "deserts", "the Moon",
    "Mars exploration", "earthquakes", "the human heart", "DNA", "antibiotics", "the Olympic Games",
    "jazz music", "Renaissance painting", "public libraries", "city parks", "bicycles", "trains",
    "time management", "job interviews", "saving money", "renewable energy", "ocean tides", "glaciers",
)
PLACES = ("Paris", "Tokyo", "Kenya", "Peru", "Norway", "Vietnam", "Canada", "Morocco", "Iceland", "New Zealand")
LANGS = ("French", "Spanish", "German", "Italian", "Portuguese")
SENTENCES = (
    "The library opens at nine o'clock every morning.", "My brother likes to cook dinner for the family.",
    "It rained all day, so we stayed inside and read books.", "Please send me the report before Friday.",
    "The train to the city leaves in ten minutes.", "She planted tomatoes and beans in her garden.",
    "We are planning a trip to the mountains next summer.", "The children played football in the park.",
)
ITEMS = ("apples", "pencils", "books", "tickets", "cookies", "marbles", "stickers", "oranges")
NAMES = ("Anna", "Ben", "Carlos", "Dina", "Eli", "Fatima", "George", "Hana")

TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What are three interesting facts about {topic}?",
    "Write a short paragraph about {topic} for a school newsletter.",
    "Give me a list of five tips related to {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a short poem about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "How would you explain {topic} to a ten-year-old?",
    "Compare {topic} and {topic2}. How are they similar and different?",
    "Write a brief introduction for a presentation on {topic}.",
    "What questions might a student ask about {topic}? List four.",
    "Describe a typical day of a person who studies {topic}.",
    "Write a short story that involves {topic}.",
    "Plan a three-day trip to {place}. What should I see?",
    "What is the weather usually like in {place}, and when is the best time to visit?",
    "Translate this sentence into {lang}: \"{sentence}\"",
    "Rewrite this sentence in a more formal tone: \"{sentence}\"",
    "Correct any mistakes and explain: \"{sentence}\"",
    "{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} does {name} have now? "
    "Explain step by step.",
    "What is {a} times {b}? Show your work.",
    "A shop sells {item} at {a} dollars each. How much do {b} {item} cost? Explain.",
    "If a train travels at {a}0 km per hour for {b} hours, how far does it go?",
    "Write an email to a friend inviting them to a picnic on Saturday.",
    "Answer the question using the passage. Passage: {topic_cap} is a subject many people study. Experts say "
    "it matters because it shapes daily life. Question: Why does {topic} matter, according to the passage?",
    "Summarize the following text in one sentence: \"{sentence} Later that day, {name} wrote about {topic} "
    "in a notebook and shared it with friends.\"",
)


def instructions(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct user requests (templates x topics x small numbers), deterministic from ``seed``."""
    if n < 1:
        raise ValueError(f"data.instructions must be >= 1, got {n}")
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"data.instructions={n}: the templates give fewer distinct requests")
        topic, topic2 = rng.sample(TOPICS, 2)
        text = rng.choice(TEMPLATES).format(
            topic=topic, topic2=topic2, topic_cap=topic[0].upper() + topic[1:], place=rng.choice(PLACES),
            lang=rng.choice(LANGS), sentence=rng.choice(SENTENCES), item=rng.choice(ITEMS), name=rng.choice(NAMES),
            a=rng.randint(2, 19), b=rng.randint(2, 9), c=rng.randint(1, 2))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
