"""Openers that steer self-written (Magpie-style) prompts towards varied kinds of request.

A bare user header lets a small target write mostly one kind of message. Starting the user turn with
one of these words and letting the target finish it spreads the prompts over tasks: code, arithmetic,
writing, explanations, advice, chat. Each opener is a generic sentence start, not a prompt.
"""

from __future__ import annotations

OPENERS: tuple[str, ...] = (
    # code
    "Write a Python",
    "Write a function",
    "In JavaScript,",
    "How do I fix",
    "What does this code",
    "Can you debug",
    "Write a SQL",
    "Explain the code",
    "In C++,",
    "How can I use",
    # numbers
    "Calculate",
    "Solve",
    "What is the sum",
    "If I have",
    "How many",
    "Find the",
    "A store sells",
    "Convert",
    # writing
    "Write a poem",
    "Write a story",
    "Write an email",
    "Write a letter",
    "Draft a",
    "Rewrite",
    "Summarize",
    "Translate",
    "Give me a title",
    "Write a short",
    "Create a list",
    "Compose",
    # knowledge
    "Why is",
    "Why do",
    "How does",
    "What is",
    "What are",
    "Who was",
    "When did",
    "Where is",
    "Explain",
    "Describe",
    "Compare",
    "What is the difference",
    "Tell me about",
    "Define",
    # advice and planning
    "How can I",
    "What should I",
    "Give me tips",
    "I need help",
    "Can you suggest",
    "Recommend",
    "Help me plan",
    "What are the benefits",
    "Is it better to",
    "List",
    # conversation
    "Hi",
    "Hello,",
    "Thanks",
    "I feel",
    "I am",
    "My friend",
    "Can you",
    "Could you",
    "Please",
    "Do you",
)
