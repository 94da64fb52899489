"""Drafting: who proposes the tokens a method verifies, behind one protocol, and the controllers that price drafts."""
