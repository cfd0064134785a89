"""The crowd's prompt set, written for kvchat (no dataset, no licence beyond the project's):
short questions a user of a chat app asks, and the long text the long user loads.

A simulated user walks the questions from its own starting point, so the users' prompts
differ from their first words (no prefix shared between them but the chat template's own
tokens), and each turn adds one question to a history that keeps the replies: the context
grows turn by turn, as a real chat's does.
"""
from __future__ import annotations

QUESTIONS = (
    "What is a good way to start learning to cook for myself?",
    "Explain how a bicycle stays upright when it moves.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Why is the sky blue during the day and red at sunset?",
    "How do I keep basil alive on a windowsill?",
    "Write a short poem about a lighthouse keeper.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery by the sea.",
    "How does a refrigerator keep food cold?",
    "Tell me a fact about octopuses that most people do not know.",
    "What should I pack for a two day hike in the mountains?",
    "Explain compound interest with a small example.",
    "How can I get better at remembering names?",
    "Why do cats knock things off tables?",
    "Describe the water cycle in four sentences.",
    "What are some tips for writing a clear email to a stranger?",
    "How do airplanes fly if they are so heavy?",
    "Recommend a simple stretching routine for the morning.",
    "What is the story of the Trojan horse?",
    "How do I explain fractions to a seven year old?",
    "Why does bread go stale?",
    "Plan a cheap dinner for four people.",
    "What makes a good password?",
    "How do bees make honey?",
    "Summarise the rules of chess in a paragraph.",
    "What is a black hole, in simple words?",
    "Give me a riddle and its answer.",
    "How can I make my small flat feel bigger?",
    "Why do we have leap years?",
    "What is the best way to learn a new language as an adult?",
    "Explain how vaccines train the immune system.",
    "Write a two line story about a lost umbrella.",
    "How do trains know where to stop?",
    "What is the difference between a lake and a pond?",
    "Suggest three board games for a family evening.",
    "How do noise cancelling headphones work?",
    "Why is the ocean salty but rivers are not?",
    "What should I ask at the end of a job interview?",
    "How do I fix a squeaky door hinge?",
    "Tell me about the first person to sail around the world.",
    "Now explain that again more briefly.",
    "Can you give me an example?",
)

# The long user's text: a report it pastes and asks about, section after section.
SECTIONS = (
    "The harbour town kept its records in a stone building near the quay, where the tide tables, the "
    "ships' manifests and the letters of the harbour masters were filed by year. Every winter the "
    "clerks copied the damaged pages into new ledgers, and every spring the ledgers were carried up "
    "the hill to the library, where they stayed dry.",
    "In the year of the great storm the sea came over the wall for three nights. The fishing boats "
    "were pulled onto the road, the market moved into the church, and the clerks carried the ledgers "
    "upstairs one armful at a time. When the water went down they found the lowest shelves soaked and "
    "the ink of forty years of tide tables running into the paper.",
    "The town council argued for a month about what to do. Some wanted a higher wall, some wanted the "
    "records moved inland, and some wanted both. The harbour master, who had seen the water reach his "
    "own door, asked for a survey of the whole coast before any stone was laid.",
    "The survey took two summers. Its authors walked the shore with chains and levels, measured the "
    "height of every wall, and asked the oldest fishermen where the sea had come in during their "
    "lives. They drew the answers on a single map, with the storm's line in red across the lower town.",
    "What the map showed surprised everyone: the water had not come over the lowest wall but around "
    "it, through a drainage channel dug a century before and forgotten. The channel ran under the "
    "market and opened behind the records building, which is why the shelves flooded first.",
    "The council closed the channel with a gate that the harbour master shut at every spring tide, "
    "and moved the oldest ledgers to the library anyway. The new wall was never built. The gate is "
    "still there, painted green, and the tide tables on its post are copied from the same ledgers.",
)

LONG_ASK = "Here is a report. Read it carefully; I will ask questions about it.\n\n"
LONG_FOLLOW = ("Here is the next part of the report.\n\n", "What changed in this part, compared with the first?")


def question(user: int, turn: int, seed: int = 0) -> str:
    """The user's question for this turn: each user (and each seed) starts at its own place
    in the set."""
    return QUESTIONS[(7 * user + 11 * seed + turn) % len(QUESTIONS)]


def long_text(words: int, part: int = 0) -> str:
    """About `words` words of the report (about 1.3 tokens a word on a Llama tokenizer),
    its sections numbered so that repeated parts are distinct text, part after part."""
    out: list[str] = []
    n, i = 0, 0
    while n < words:
        k = len(SECTIONS) * part + i
        section = f"Section {part + 1}.{i + 1}. {SECTIONS[k % len(SECTIONS)]}"
        out.append(section)
        n += len(section.split())
        i += 1
    return "\n\n".join(out)
