import sys

sys.path.insert(0, "/app")
from textstats import top_words

cases = [
    (("The cat and the hat. THE END!", 2), [("the", 3), ("and", 1)]),
    (("b a c b a", 3), [("a", 2), ("b", 2), ("c", 1)]),
    (("Hello, hello; HELLO? world", 5), [("hello", 3), ("world", 1)]),
    (("don't stop, don't", 1), [("don't", 2)]),
    (("", 3), []),
]
for (text, n), want in cases:
    got = top_words(text, n)
    if list(got) != want:
        sys.exit(f"top_words({text!r}, {n}) = {got!r}, want {want!r}")
