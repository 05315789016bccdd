"""A small built-in list of varied user prompts (written for this project) that seeds the draft dataset.

The list is deliberately short: most training prompts are written by the target itself (Magpie-style,
see `data.py`). These cover kinds of requests the target might not produce on its own.
"""

from __future__ import annotations

SEED_PROMPTS: tuple[str, ...] = (
    # coding
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and case.",
    "Explain the difference between a list and a tuple in Python, with a short example of each.",
    "How do I read a CSV file into a dictionary per row in Python?",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "What does the `git rebase` command do, and when should I avoid it?",
    "Write a JavaScript function that removes duplicate numbers from an array.",
    "Explain what a race condition is and give a simple way to prevent one.",
    "Write a bash one-liner that counts the lines in every .txt file in a folder.",
    "What is the time complexity of binary search, and why?",
    "Refactor this loop into a list comprehension: result = []; for x in range(10): result.append(x * x)",
    "Write a short C function that reverses a string in place.",
    "What is the difference between a process and a thread?",
    # math
    "What is 17 multiplied by 23? Show your working.",
    "Solve for x: 3x + 7 = 22.",
    "A train travels 180 km in 2.5 hours. What is its average speed?",
    "Explain what a prime number is and list the primes below 30.",
    "What is the derivative of x^3 + 2x^2 - 5x + 1?",
    "If a shirt costs $40 and is discounted by 15%, what is the sale price?",
    "Explain the Pythagorean theorem with a worked example.",
    "What is the probability of rolling two sixes with two fair dice?",
    "Convert 72 degrees Fahrenheit to Celsius.",
    "What is the sum of the integers from 1 to 100, and how can you compute it quickly?",
    # writing
    "Write a four-line poem about autumn rain.",
    "Write a short, polite email asking my manager for a day off next Friday.",
    "Give me three title ideas for a blog post about learning to cook.",
    "Write the opening paragraph of a mystery story set in a lighthouse.",
    "Summarize the plot of Little Red Riding Hood in three sentences.",
    "Rewrite this sentence to sound more formal: 'hey, can u send me the file asap?'",
    "Write a product description for a reusable water bottle.",
    "Write a haiku about a city at night.",
    "Draft a thank-you note to a friend who helped me move house.",
    "Write a short motivational message for someone starting a new job.",
    # question answering / knowledge
    "Why is the sky blue?",
    "What causes the seasons on Earth?",
    "Who wrote 'Pride and Prejudice', and what is it about?",
    "What is photosynthesis? Explain it simply.",
    "What is the capital of Australia, and why is it not Sydney?",
    "How do vaccines help the immune system?",
    "What is the difference between weather and climate?",
    "Explain how a rainbow forms.",
    "What are the main causes of inflation?",
    "How does a refrigerator keep food cold?",
    # chat / advice
    "Hi! How are you today?",
    "I feel nervous about a presentation tomorrow. Any tips?",
    "Can you recommend a few hobbies I could start on a small budget?",
    "What are some good habits for getting better sleep?",
    "I want to learn a new language. Where should I start?",
    "What's a healthy breakfast I can make in five minutes?",
    "Tell me a fun fact about octopuses.",
    "How can I stay focused when working from home?",
    # instructions / transformation
    "List five tips for writing a good resume.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Give step-by-step instructions for making a cup of tea.",
    "Classify these animals as mammals or birds: eagle, dolphin, penguin, bat, sparrow.",
    "Turn this list into a sentence: apples, bread, milk, eggs.",
    "Extract the dates from this text: 'The meeting moved from March 3 to April 10, 2024.'",
    "Explain the rules of tic-tac-toe to a child.",
    "Give me a packing checklist for a weekend camping trip.",
    "Compare electric cars and petrol cars in a short table.",
    "Write three multiple-choice questions about the solar system, with answers.",
    "Describe the water cycle in five short steps.",
    "What are the pros and cons of working in an open-plan office?",
)
