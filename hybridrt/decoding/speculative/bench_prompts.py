"""Built-in prompts for `hybridrt bench --spec-prompt`: one where prompt lookup pays, one where it
cannot (the floor)."""

# Text that is mostly a copy of itself: prompt lookup should accept long runs.
ECHO_PROMPT = (
    "Copy the following list exactly, three times.\n"
    "List: red apple, green pear, yellow banana, purple grape, orange mango, brown coconut, "
    "pink peach, white onion, black olive, blue berry.\n"
    "Copy 1: red apple, green pear, yellow banana, purple grape, orange mango, brown coconut, "
    "pink peach, white onion, black olive, blue berry.\n"
    "Copy 2: red apple, green pear, yellow banana, purple grape, orange mango, brown coconut, "
    "pink peach, white onion, black olive, blue berry.\n"
    "Copy 3: red apple, green"
)

# Free text with many repeated short n-grams whose continuations differ: lookups hit, drafts fail.
# It ends inside a clause ("the mayor found"): ending at "the mayor" let SmolLM2 leave the
# pattern for a story of its own, whose n-grams repeat, and whether its drafts failed then turned
# on a near-tie (an ulp in attention flipped it); mid-clause, none of 4-30 drafts is accepted on
# either activation path.
ADVERSARIAL_PROMPT = (
    "Write a short original story. In the town, the baker sold bread; in the town, the smith "
    "made nails; in the town, the child found a cat; in the town, the river froze; in the "
    "town, the mayor found"
)

BUILTIN_PROMPTS = {"echo": ECHO_PROMPT, "adversarial": ADVERSARIAL_PROMPT}
