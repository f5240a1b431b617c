"""Built-in prompts for self-distillation: the target writes its own training text from these.

Training and held-out prompts are disjoint (different topics and wordings); the held-out ones are
what `scripts/bench_mtp.py` measures acceptance and speed on. `chat` prompts are wrapped in the
model's chat template, `text` ones are continued as they are.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    kind: str       # "chat" or "text"
    domain: str     # chat, prose, code, list, qa, ... (for the report only)
    text: str


def _chat(domain: str, *texts: str) -> list[Prompt]:
    return [Prompt("chat", domain, t) for t in texts]


def _text(domain: str, *texts: str) -> list[Prompt]:
    return [Prompt("text", domain, t) for t in texts]


TRAIN_PROMPTS: list[Prompt] = [
    *_chat("chat",
           "Hi! Can you tell me a little about yourself?",
           "What should I cook for dinner tonight if I only have rice, eggs and spinach?",
           "I feel nervous about a job interview tomorrow. Any advice?",
           "Suggest a name for my new puppy, she is small and very energetic.",
           "How do I politely decline an invitation to a party?",
           "What are some good habits for getting better sleep?",
           "Recommend three books for someone who likes science fiction.",
           "Can you help me plan a weekend trip to the mountains?"),
    *_chat("qa",
           "Why is the sky blue?",
           "What is the difference between weather and climate?",
           "How does a vaccine train the immune system?",
           "What causes the seasons on Earth?",
           "Explain what inflation is in simple terms.",
           "How do airplanes stay in the air?",
           "What is photosynthesis?",
           "Who built the pyramids of Giza and how?",
           "What is the capital of Australia and why was it chosen?",
           "How does a computer store numbers?"),
    *_chat("code",
           "Write a Python function that checks whether a string is a palindrome.",
           "Write a JavaScript function that returns the largest number in an array.",
           "Explain what a hash map is and write a small example in Python.",
           "Write a SQL query that counts orders per customer.",
           "Write a bash script that renames all .txt files in a folder to .md.",
           "How do I read a CSV file in Python? Show code.",
           "Write a C function that reverses a linked list.",
           "Write a Python class for a simple bank account with deposit and withdraw."),
    *_chat("list",
           "List ten fruits and their colors.",
           "Give me a packing list for a beach holiday.",
           "List the planets of the solar system in order with one fact each.",
           "What are five tips for learning a new language?",
           "Give me a weekly workout plan for a beginner."),
    *_chat("writing",
           "Write a short poem about the ocean at night.",
           "Write a short story about a robot who learns to paint.",
           "Write an email to my landlord asking to fix the heating.",
           "Summarize the plot of Romeo and Juliet in a few sentences.",
           "Write a product description for a reusable water bottle."),
    *_text("prose",
           "Once upon a time, in a small village at the edge of a great forest,",
           "The history of the printing press begins in the fifteenth century, when",
           "In the morning the market was already crowded with",
           "Scientists have long wondered how birds navigate over thousands of miles.",
           "The old lighthouse keeper climbed the stairs one last time and",
           "Chapter 1\n\nThe rain had not stopped for three days when"),
    *_text("code",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "import os\nimport sys\n\n\ndef main():\n",
           "// A simple counter component in JavaScript\nfunction Counter() {\n",
           "#include <stdio.h>\n\nint main(void) {\n",
           "class Stack:\n    def __init__(self):\n"),
    *_text("list",
           "Ingredients:\n1. 2 cups of flour\n2.",
           "Top 10 most visited cities in the world:\n1.",
           "Meeting notes, Monday:\n- "),
    *_text("qa",
           "Question: What is the boiling point of water at sea level?\nAnswer:",
           "Q: How many legs does a spider have?\nA:",
           "FAQ\n\nQ: How do I reset my password?\nA:"),
]

HELDOUT_PROMPTS: list[Prompt] = [
    *_chat("chat", "My friend is moving to another city. What could I give her as a goodbye present?"),
    *_chat("qa", "How do volcanoes form?"),
    *_chat("code", "Write a Python function that counts how many times each word appears in a text."),
    *_chat("writing", "Write a short story about a lost key and an old clock."),
    *_chat("list", "List six animals that live in the desert, with one sentence about each."),
    *_text("prose", "The first time she saw the city from the train window, she"),
    *_text("code", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"),
    *_text("qa", "Question: Why do leaves change color in autumn?\nAnswer:"),
    # the eight above alone read 10 points below these 32 on Gemma 3's head (35 % vs 46 % walked):
    # too few to measure a head by
    *_chat("chat",
           "What are the main differences between cats and dogs as pets?",
           "How can I improve my public speaking skills?",
           "Help me write a birthday message for my grandmother.",
           "How do I change a flat tire?"),
    *_chat("qa",
           "Explain how a refrigerator keeps food cold.",
           "What is machine learning, in simple words?",
           "Why do we have leap years?",
           "What are the benefits of drinking water?",
           "Describe the water cycle.",
           "What is the difference between a virus and a bacterium?"),
    *_chat("code",
           "Write a Python script that prints the multiplication table from 1 to 10.",
           "Explain recursion with an example in JavaScript."),
    *_chat("writing",
           "Write a haiku about autumn leaves.",
           "Write a limerick about a clumsy wizard."),
    *_chat("list",
           "Can you give me a recipe for banana bread?",
           "Give me three ideas for a science fair project."),
    *_text("prose",
           "The museum opened its doors at nine, and the first visitors",
           "In 1869, the transcontinental railroad",
           "The small boat drifted toward the island as the sun"),
    *_text("code", "def is_prime(n):\n"),
    *_text("writing", "Dear Sir or Madam,\n\nI am writing to"),
    *_text("list",
           "The recipe calls for three eggs, a cup of sugar and",
           "Step 1: Preheat the oven to 180 degrees.\nStep 2:"),
    *_text("qa", "Q: What is the largest ocean on Earth?\nA:"),
]
