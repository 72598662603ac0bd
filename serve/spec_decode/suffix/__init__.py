"""Suffix decoding: `index` reads drafts off what was already written, `draft` serves it (alone or
beside a head, as their hybrid), `calibration` learns what its probabilities are worth."""
