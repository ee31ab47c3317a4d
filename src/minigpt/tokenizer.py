"""A character tokenizer with a fixed alphabet, so every checkpoint shares one vocabulary."""

from __future__ import annotations

PAD, EOS = "<pad>", "<eos>"
ALPHABET = " 0123456789abcdefghijklmnopqrstuvwxyz+-=?:,"


class CharTokenizer:
    """id 0 is padding, id 1 ends an answer, then one id per character of `alphabet`."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet must not repeat characters")
        self.alphabet = alphabet
        self.specials = [PAD, EOS]
        self.pad_id, self.eos_id = 0, 1
        self._stoi = {ch: i + len(self.specials) for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet "
                             f"{self.alphabet!r}") from None

    def decode(self, ids) -> str:
        """Inverse of encode; stops at the first <eos> and drops padding."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i == self.pad_id:
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
            out.append(self.alphabet[i - len(self.specials)])
        return "".join(out)
