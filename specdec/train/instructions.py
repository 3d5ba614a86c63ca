"""Self-distillation prompts for a chat target (``data.corpus=instructions``): task families x fillers.

A chat model drafts for its own answers to user requests, so its drafter trains on
those answers. The requests here come from task families — writing, role-play,
reasoning, math and word problems, coding, extraction, STEM and humanities
explanations, translation, summarising a passage, short factual questions,
answering from a passage: the kinds of turn a chat benchmark asks, but none of its
questions — each a few templates filled with topics, names, places, numbers and
short texts picked by a seeded generator. :func:`instructions` is a pure function of
``(n, seed)``, and ``instructions(n)`` is a prefix of ``instructions(m)`` for
``n < m``. Each request is rendered through the target's chat template as one user
turn; the target's greedy answer to it is the training text (:mod:`specdec.train.data`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

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
    "artificial intelligence", "cybersecurity", "3D printing", "nuclear power", "the periodic table",
    "plate tectonics", "the solar system", "coral reefs", "migratory birds", "the Industrial Revolution",
    "the Cold War", "democracy", "urban planning", "public transport", "minimalism", "meditation",
    "video games", "podcasts", "online education", "volunteering", "team sports", "street food",
    "fermentation", "wind turbines", "water pollution", "smartphones", "cryptocurrency", "small businesses",
    "the Great Wall of China", "the Amazon river", "dinosaurs", "tea ceremonies", "photography",
)
STEM = (
    "Newton's laws of motion", "entropy", "the theory of relativity", "quantum entanglement", "natural selection",
    "the Krebs cycle", "chemical bonds", "acids and bases", "electromagnetic waves", "the greenhouse effect",
    "neural networks", "public-key cryptography", "sorting algorithms", "recursion", "compound interest",
    "probability distributions", "the Pythagorean theorem", "prime numbers", "derivatives in calculus",
    "how vaccines train the immune system", "how batteries store energy", "how GPS works", "superconductivity",
    "cell division", "how search engines rank pages", "the speed of sound", "osmosis", "gene editing with CRISPR",
    "how airplanes stay in the air", "the Doppler effect", "hash tables", "the big bang theory",
)
HUMANITIES = (
    "the causes of the First World War", "the role of the Renaissance in European culture", "utilitarianism",
    "the social contract", "the influence of Shakespeare on the English language", "the impact of colonialism",
    "the role of central banks", "the effects of globalization", "the rise of cities in the Middle Ages",
    "the importance of the Magna Carta", "the philosophy of Confucius", "the Harlem Renaissance",
    "unemployment and inflation", "the trade-offs of minimum wage laws", "propaganda in wartime",
    "the ethics of artificial intelligence", "the history of writing systems", "the spread of religions",
    "the role of museums in society", "the Enlightenment", "free speech", "the welfare state",
)
PLACES = ("Paris", "Tokyo", "Kenya", "Peru", "Norway", "Vietnam", "Canada", "Morocco", "Iceland", "New Zealand",
          "Lisbon", "Mexico City", "Istanbul", "Bali", "Scotland", "Chile", "Egypt", "Seoul", "Vienna", "Cape Town")
LANGS = ("French", "Spanish", "German", "Italian", "Portuguese")
SENTENCES = (
    "The library opens at nine o'clock every morning.", "My brother likes to cook dinner for the family.",
    "It rained all day, so we stayed inside and read books.", "Please send me the report before Friday.",
    "The train to the city leaves in ten minutes.", "She planted tomatoes and beans in her garden.",
    "We are planning a trip to the mountains next summer.", "The children played football in the park.",
    "Their new office is close to the river and has a big kitchen.", "I forgot my umbrella at the restaurant.",
    "He has been learning to play the piano for three years.", "The museum will be closed on Monday.",
    "Our team finished the project two days early.", "The doctor told him to drink more water.",
)
GERMAN = (
    "Die Regierung hat am Dienstag ein neues Gesetz zur Energiepolitik vorgestellt.",
    "Viele Menschen fahren im Sommer mit dem Zug an die Küste.",
    "Der Bürgermeister eröffnete gestern die neue Bibliothek im Stadtzentrum.",
    "Die Preise für Lebensmittel sind im letzten Jahr stark gestiegen.",
    "Nach dem Spiel feierten die Fans bis spät in die Nacht.",
    "Das Unternehmen plant, im nächsten Jahr zweihundert neue Mitarbeiter einzustellen.",
    "Wegen des starken Regens wurde das Konzert im Park abgesagt.",
    "Die Forscher haben eine neue Art von Frosch im Regenwald entdeckt.",
    "Meine Schwester studiert Medizin an der Universität in Berlin.",
    "Der Flughafen wird wegen Bauarbeiten für drei Wochen teilweise geschlossen.",
    "Immer mehr Schulen setzen im Unterricht auf Tablets und Laptops.",
    "Die Polizei sucht nach Zeugen eines Unfalls auf der Autobahn.",
)
ITEMS = ("apples", "pencils", "books", "tickets", "cookies", "marbles", "stickers", "oranges", "cupcakes", "stamps")
NAMES = ("Anna", "Ben", "Carlos", "Dina", "Eli", "Fatima", "George", "Hana", "Ivan", "Julia", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya")
ROLES = ("a pirate captain", "a museum tour guide", "a friendly family doctor", "a famous chef", "a detective",
         "a high-school chemistry teacher", "a personal fitness coach", "a medieval knight", "a startup founder",
         "a travel agent", "an astronaut on the space station", "a librarian", "a sports commentator",
         "a wise old wizard", "a customer service agent", "a park ranger")
PRODUCTS = ("a reusable water bottle", "a smart watch", "noise-cancelling headphones", "an electric bicycle",
            "a standing desk", "a coffee grinder", "a hiking backpack", "a language-learning app",
            "a solar phone charger", "a robot vacuum cleaner")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists into one sorted list",
    "finds the largest element in a list", "removes duplicates from a list while keeping the order",
    "checks whether a word is a palindrome", "counts how often each word appears in a text",
    "computes the factorial of a number", "performs binary search on a sorted list",
    "converts a temperature from Celsius to Fahrenheit", "flattens a nested list",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers", "reads a CSV file and prints the average of a column",
    "finds the longest common prefix of a list of strings", "rotates a list by k positions",
    "validates an email address with a regular expression",
)
CODE_LANGS = ("Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust")
SNIPPETS = (
    "def f(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x\n    return total",
    "def g(s):\n    return ''.join(sorted(set(s)))",
    "def h(n):\n    if n < 2:\n        return n\n    return h(n - 1) + h(n - 2)",
    "def avg(xs):\n    return sum(xs) / len(xs)",
    "def find(xs, t):\n    for i in range(len(xs)):\n        if xs[i] == t:\n            return i\n    return -1",
    "result = [x * x for x in range(10) if x % 3 == 0]\nprint(result)",
)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
COMPANIES = ("Northwind", "BlueRiver", "Sunpeak", "Greenfield Labs", "Orbitex", "Maple & Co", "Quantia", "Redstone")
QA = (
    "Who wrote the novel Pride and Prejudice?", "What is the capital of Australia?", "How many bones are in the "
    "adult human body?", "When did the first person walk on the Moon?", "What is the largest planet in our solar "
    "system?", "Who painted the Mona Lisa?", "What is the boiling point of water at sea level in Fahrenheit?",
    "Which ocean is the largest?", "Who invented the telephone?", "What language is spoken in Brazil?",
    "How long does it take light from the Sun to reach Earth?", "What is the chemical symbol for gold?",
    "Who was the first president of the United States?", "What is the tallest mountain in Africa?",
    "How many players are on a soccer team on the field?", "What does a thermometer measure?",
    "Which country is home to the kangaroo?", "What is the longest river in Europe?",
    "Who discovered penicillin?", "In which year did the Berlin Wall fall?",
)


def _news(rng: random.Random) -> str:
    """A short made-up news passage (for summary and reading questions)."""
    name, name2 = rng.sample(NAMES, 2)
    place, company, month = rng.choice(PLACES), rng.choice(COMPANIES), rng.choice(MONTHS)
    topic = rng.choice(TOPICS)
    n, m = rng.randint(12, 480), rng.randint(2, 9)
    return rng.choice((
        f"{company}, a company based in {place}, announced in {month} that it will invest {m} million dollars in "
        f"{topic}. Chief executive {name} said the project would create about {n} jobs over the next {m} years. "
        f"Local officials welcomed the plan, although some residents, including {name2}, worried about traffic and "
        f"rising rents near the new site. Work is expected to begin next spring.",
        f"A study published in {month} by researchers in {place} suggests that {topic} may matter more for "
        f"everyday health than previously thought. The team, led by {name}, followed {n} volunteers for {m} years. "
        f"Those who took part reported better sleep and lower stress. {name2}, who was not involved in the study, "
        f"said the results were promising but that larger trials are needed.",
        f"Heavy storms hit {place} on Sunday, closing roads and schools for {m} days. Around {n} homes lost power. "
        f"Emergency services said nobody was seriously hurt. {name}, a shop owner, said the water reached the "
        f"front door within an hour. The city plans to spend more on flood defences, a spokesperson named {name2} said.",
        f"The city council of {place} voted in {month} to open a new public library focused on {topic}. The building "
        f"will hold about {n} thousand books and offer free classes for children and adults. Council member {name} "
        f"called it a long-awaited investment, while {name2} argued the money should go to repairing roads first.",
    ))


def _writing(rng: random.Random) -> str:
    topic, place, name = rng.choice(TOPICS), rng.choice(PLACES), rng.choice(NAMES)
    return rng.choice((
        f"Write a travel blog post about a week in {place}, covering food, culture and places to visit.",
        f"Write a short paragraph about {topic} for a school newsletter.",
        f"Write a short poem about {topic}.",
        f"Write a haiku about {topic}.",
        f"Write a short story that involves {topic} and a character named {name}.",
        f"Draft a professional email to your manager asking for feedback on a report about {topic}.",
        f"Write an email to a friend inviting them to a picnic in {place} on Saturday.",
        f"Write a persuasive essay of about 200 words arguing that schools should teach more about {topic}.",
        f"Write a product description for {rng.choice(PRODUCTS)} for an online shop.",
        f"Write a short review of {rng.choice(PRODUCTS)} from the point of view of a happy customer.",
        f"Create an outline for a blog post about {topic}, with headings and key points.",
        f"Write a brief introduction for a presentation on {topic}.",
        f"Write a cover letter for a job at a company that works on {topic}.",
        f"Write a short speech to welcome new students to a club about {topic}.",
        f"Write a dialogue between two friends who disagree about {topic}.",
        f"Write a limerick about {name} and {topic}.",
        f"Write a thank-you note to a teacher who taught you about {topic}.",
        f"Rewrite this sentence in a more formal tone: \"{rng.choice(SENTENCES)}\"",
        f"Correct any mistakes and explain: \"{rng.choice(SENTENCES)}\"",
    ))


def _roleplay(rng: random.Random) -> str:
    role, topic, place = rng.choice(ROLES), rng.choice(TOPICS), rng.choice(PLACES)
    return rng.choice((
        f"Pretend you are {role}. Explain {topic} to a visitor in your own style.",
        f"Imagine you are {role}. A customer asks you for advice about {topic}. What do you say?",
        f"Act as {role} and describe your typical day.",
        f"You are {role} on a trip to {place}. Describe what you see and how you feel.",
        f"Role-play as {role}: give a short motivational talk to a group of beginners.",
        f"Stay in character as {role} and answer: what is the most important lesson you have learned?",
    ))


def _reasoning(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    n, m = rng.randint(3, 12), rng.randint(2, 6)
    return rng.choice((
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
        f"In a race, {a} finished ahead of {b} but behind {c}. Who came first, second and third?",
        f"All the {rng.choice(ITEMS)} in the box are red. Some red things are heavy. Can we conclude that some "
        f"{rng.choice(ITEMS)} in the box are heavy? Explain.",
        f"There are {n} people in a room and each shakes hands with every other person once. How many handshakes "
        f"are there? Explain step by step.",
        f"{a} is {n} years old. {b} is {m} years older than {a}, and {c} is twice as old as {b}. How old is {c}?",
        f"If it takes {m} machines {m} minutes to make {m} widgets, how long would it take {n * 10} machines to "
        f"make {n * 10} widgets? Explain.",
        f"What comes next in the sequence {m}, {2 * m}, {4 * m}, {8 * m}, ...? Explain the pattern.",
        f"{a}, {b} and {c} each own a different pet: a cat, a dog and a fish. {a} does not own the dog. {c} owns "
        f"the fish. Who owns which pet?",
        f"A farmer has {n + 5} sheep. All but {m} run away. How many sheep does the farmer have left? Explain.",
    ))


def _math(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 19), rng.randint(2, 9), rng.randint(1, 2)
    p = rng.choice((10, 15, 20, 25, 30, 40, 50))
    return rng.choice((
        f"{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} does {name} have now? "
        f"Explain step by step.",
        f"What is {a} times {b}? Show your work.",
        f"A shop sells {item} at {a} dollars each. How much do {b} {item} cost? Explain.",
        f"If a train travels at {a}0 km per hour for {b} hours, how far does it go?",
        f"Solve for x: {b}x + {a} = {a + b * (c + 3)}. Show each step.",
        f"What is {p}% of {a * 20}? Explain how you got the answer.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"The prices of {b} items are {', '.join(str(rng.randint(3, 40)) for _ in range(b))} dollars. What is the "
        f"average price?",
        f"You roll two fair dice. What is the probability that the sum is {rng.randint(4, 10)}? Explain.",
        f"{name} saves {a} dollars a week. A bike costs {a * b * 4 + 7} dollars. How many weeks until {name} can "
        f"buy it?",
        f"A jacket costs {a * 10} dollars and is on sale for {p}% off. What is the sale price?",
        f"{name} reads {a} pages a day. The book has {a * (b + 10) + 3} pages. How many days does {name} need to "
        f"finish it? Explain.",
        f"A recipe needs {c} cups of flour for {b} cookies. How much flour is needed for {b * a} cookies?",
        f"Convert {a * 3} kilometres to miles and explain the conversion.",
        f"A circle has a radius of {b} cm. What are its circumference and area?",
    ))


def _coding(rng: random.Random) -> str:
    task, lang = rng.choice(CODE_TASKS), rng.choice(CODE_LANGS)
    return rng.choice((
        f"Write a {lang} function that {task}.",
        f"Write a {lang} function that {task}, and explain how it works.",
        f"Implement a function in {lang} that {task}. Include a few test cases.",
        f"What is the time complexity of a function that {task}? Give an example in {lang}.",
        f"Explain what this code does:\n```python\n{rng.choice(SNIPPETS)}\n```",
        f"Find any bug or edge case in this code and suggest a fix:\n```python\n{rng.choice(SNIPPETS)}\n```",
        f"Write a SQL query that lists the {rng.randint(3, 10)} customers with the highest total order amount from "
        f"tables customers(id, name) and orders(id, customer_id, amount).",
        f"Explain the difference between a list and a dictionary in {lang if lang == 'Python' else 'Python'}, "
        f"with examples.",
    ))


def _extraction(rng: random.Random) -> str:
    news = _news(rng)
    names = rng.sample(NAMES, 3)
    scores = [rng.randint(1, 5) for _ in range(3)]
    review = " ".join(f"{i + 1}. {s}" for i, s in enumerate(rng.sample((
        "The food was excellent and the staff were very kind.", "It broke after two days. Very disappointing.",
        "Decent value for the price, nothing special.", "The best concert I have been to in years!",
        "The hotel room was dirty and noisy.", "Shipping was fast and the quality is fine."), 3)))
    return rng.choice((
        f"Extract all the names of people, places and organisations from this text and return them as JSON: {news}",
        f"Rate each of these reviews from 1 (very negative) to 5 (very positive) and return the scores as a list: "
        f"{review}",
        f"From the following text, list the key numbers and what they refer to: {news}",
        f"Turn this information into a markdown table with columns name and score: {names[0]} scored {scores[0]}, "
        f"{names[1]} scored {scores[1]}, {names[2]} scored {scores[2]}.",
        f"Identify the main claim and the supporting evidence in this passage: {news}",
    ))


def _explain(rng: random.Random) -> str:
    topic, topic2 = rng.sample(TOPICS, 2)
    subject = rng.choice(STEM + HUMANITIES + TOPICS)
    return rng.choice((
        f"Explain {subject} in simple terms.",
        f"What is {subject}, and why does it matter?",
        f"How would you explain {subject} to a ten-year-old?",
        f"Describe {subject} in detail, with an example.",
        f"What are three interesting facts about {topic}?",
        f"Give me a list of five tips related to {topic}.",
        f"What are the advantages and disadvantages of {topic}?",
        f"Summarize the history of {topic} in a few sentences.",
        f"Compare {topic} and {topic2}. How are they similar and different?",
        f"What questions might a student ask about {topic}? List four.",
        f"What are common misconceptions about {subject}?",
        f"Plan a three-day trip to {rng.choice(PLACES)}. What should I see?",
        f"What is the weather usually like in {rng.choice(PLACES)}, and when is the best time to visit?",
    ))


def _translate(rng: random.Random) -> str:
    return rng.choice((
        f"Translate German to English: {rng.choice(GERMAN)}",
        f"Translate German to English: {rng.choice(GERMAN)}",
        f"Translate this sentence into {rng.choice(LANGS)}: \"{rng.choice(SENTENCES)}\"",
    ))


def _summarize(rng: random.Random) -> str:
    return rng.choice(("Summarize: ", "Summarize the following article in two sentences: ",
                       "Write a short summary of this news story: ")) + _news(rng)


def _qa(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(QA)
    topic, place = rng.choice(TOPICS), rng.choice(PLACES)
    return rng.choice((
        f"Who is known for important work on {topic}?", f"When did people first start studying {topic}?",
        f"What is {place} famous for?", f"Why is {topic} important?", f"Where can you learn more about {topic}?",
    ))


def _passage(rng: random.Random) -> str:
    news = _news(rng)
    return rng.choice((
        f"{news} Question: According to the passage, what happened and who was involved?",
        f"Answer the question using the passage. Passage: {news} Question: What concerns were raised?",
        f"Read the text and answer: what is the main point? Text: {news}",
    ))


FAMILIES: tuple[tuple[Callable[[random.Random], str], int], ...] = (
    (_writing, 4), (_roleplay, 2), (_reasoning, 2), (_math, 3), (_coding, 3), (_extraction, 2),
    (_explain, 4), (_translate, 1), (_summarize, 1), (_qa, 1), (_passage, 1),
)


def instructions(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct user requests (task families x fillers), deterministic from ``seed``;
    a prefix of the list for any larger ``n``."""
    if n < 1:
        raise ValueError(f"data.instructions must be >= 1, got {n}")
    rng = random.Random(seed)
    makers = [f for f, w in FAMILIES for _ in range(w)]
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"data.instructions={n}: the templates give fewer distinct requests")
        text = rng.choice(makers)(rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
