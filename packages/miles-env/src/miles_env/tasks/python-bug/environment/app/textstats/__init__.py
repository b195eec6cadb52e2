from textstats.words import top_words

__all__ = ["top_words"]
