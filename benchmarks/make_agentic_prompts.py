"""Write the `agentic` prompt set (src/specdec/data/prompts/agentic.jsonl): requests whose structure recurs.

Four categories, twelve requests each, in the order a client would send them: JSON records of one schema from
free-text notes, SQL over one schema, functions in one house style, and tool-using agent steps. Each request carries
one worked example (what a base model needs to answer in the format), and the rest of its structure (field order,
clause order, docstring layout, step layout) recurs in earlier *answers*: the workload class of agent loops, tool calls
and structured extraction, where drafts from earlier answers pay. Run: python benchmarks/make_agentic_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "specdec" / "data" / "prompts" / "agentic.jsonl"

JSON_HEAD = (
    "Convert each customer note into a JSON record with the fields name, age, city, plan, email and newsletter.\n\n"
    "Note: Maria Lopez, 34, lives in Madrid and wants the premium plan; write to maria.lopez@example.com, no "
    "newsletter.\n"
    'Record: {"name": "Maria Lopez", "age": 34, "city": "Madrid", "plan": "premium", '
    '"email": "maria.lopez@example.com", "newsletter": false}\n\n'
)
NOTES = [
    "Tom Becker (41) from Hamburg signed up for the basic plan, email tom.becker@example.org, wants the newsletter.",
    "Aiko Tanaka, aged 29, Osaka. Plan: team. Contact aiko.t@example.jp. Newsletter yes.",
    "New customer: Pierre Martin, 52, Lyon, premium plan, pierre.martin@example.fr, no newsletter please.",
    "Lena Novak is 23 and lives in Prague; she picked the basic plan (lena.novak@example.cz) and the newsletter.",
    "Customer Omar Haddad, 37, Dubai, team plan, omar.haddad@example.ae, newsletter: no.",
    "Sofia Rossi (45), Milan — premium plan — sofia.rossi@example.it — subscribe her to the newsletter.",
    "Jonas Berg, 31, Oslo, basic plan; email jonas.berg@example.no; does not want the newsletter.",
    "Chen Wei, 27, Shanghai, chose the team plan. chen.wei@example.cn. Newsletter: yes.",
    "Ana Costa, sixty years old (60), from Lisbon, premium, ana.costa@example.pt, no newsletter.",
    "Liam O'Brien, 38, Dublin, basic plan, liam.obrien@example.ie, wants the newsletter.",
    "Fatima Zahra, 33, Casablanca, team plan, fatima.zahra@example.ma, newsletter no.",
    "Noah Schmidt, 26, Zurich, premium plan, noah.schmidt@example.ch, newsletter yes.",
]

SQL_HEAD = (
    "-- PostgreSQL schema of the shop\n"
    "-- customers(id, name, city, created_at)\n"
    "-- orders(id, customer_id, total_cents, status, created_at)\n"
    "-- order_items(order_id, product_id, quantity, price_cents)\n"
    "-- products(id, name, category, price_cents)\n\n"
    "-- Question: the ten customers who spent the most in 2024\n"
    "SELECT c.id, c.name, SUM(o.total_cents) AS spent_cents\n"
    "FROM customers AS c\n"
    "JOIN orders AS o ON o.customer_id = c.id\n"
    "WHERE o.status = 'paid' AND o.created_at >= '2024-01-01' AND o.created_at < '2025-01-01'\n"
    "GROUP BY c.id, c.name\n"
    "ORDER BY spent_cents DESC\n"
    "LIMIT 10;\n\n"
)
QUESTIONS = [
    "the five cities with the most paid orders in 2024",
    "the best-selling products by quantity in March 2024",
    "customers who placed more than three paid orders in 2024",
    "the average paid order total per city in 2024",
    "revenue per product category in the first quarter of 2024",
    "the ten products with the highest revenue in 2024",
    "customers from Berlin who spent more than 500 euros in 2024",
    "the number of refunded orders per month in 2024",
    "the largest single paid order of each customer in 2024",
    "products never ordered in 2024",
    "the share of paid orders per status in December 2024",
    "new customers per city who placed a paid order within a week of signing up in 2024",
]

CODE_HEAD = (
    "from __future__ import annotations\n\n"
    "import logging\n"
    "from pathlib import Path\n\n"
    "from shop.models import Customer, Invoice, Order, Product, Refund, Shipment\n"
    "from shop.store import Store\n\n"
    "log = logging.getLogger(__name__)\n\n\n"
    "def load_customer(store: Store, customer_id: int) -> Customer:\n"
    '    """Load one customer by id.\n\n'
    "    Args:\n"
    "        store: the open store.\n"
    "        customer_id: the customer's id.\n\n"
    "    Returns:\n"
    "        The customer.\n\n"
    "    Raises:\n"
    "        KeyError: when no customer has this id.\n"
    '    """\n'
    '    log.debug("loading customer %d", customer_id)\n'
    '    row = store.fetch_one("SELECT * FROM customers WHERE id = ?", (customer_id,))\n'
    "    if row is None:\n"
    '        raise KeyError(f"no customer {customer_id}")\n'
    "    return Customer.from_row(row)\n\n\n"
)
FUNCTIONS = [
    ("load_order", "order_id: int", "Order", "order"),
    ("load_product", "product_id: int", "Product", "product"),
    ("load_invoice", "invoice_id: int", "Invoice", "invoice"),
    ("load_shipment", "shipment_id: int", "Shipment", "shipment"),
    ("load_refund", "refund_id: int", "Refund", "refund"),
    ("orders_of_customer", "customer_id: int", "list[Order]", "the orders of one customer"),
    ("products_in_category", "category: str", "list[Product]", "the products of one category"),
    ("invoices_of_order", "order_id: int", "list[Invoice]", "the invoices of one order"),
    ("shipments_of_order", "order_id: int", "list[Shipment]", "the shipments of one order"),
    ("refunds_of_order", "order_id: int", "list[Refund]", "the refunds of one order"),
    ("latest_order", "customer_id: int", "Order", "the latest order of one customer"),
    ("cheapest_product", "category: str", "Product", "the cheapest product of one category"),
]

AGENT_HEAD = (
    "An assistant answers questions with the tools search[query], lookup[page, term] and finish[answer]. "
    "Each step is a Thought, an Action and its Observation.\n\n"
    "Question: Which river flows through the capital of Austria?\n"
    "Thought 1: The capital of Austria is Vienna. I need the river that flows through Vienna.\n"
    "Action 1: search[Vienna]\n"
    "Observation 1: Vienna is the capital of Austria. It lies on the Danube.\n"
    "Thought 2: Vienna lies on the Danube, so the river is the Danube.\n"
    "Action 2: finish[Danube]\n\n"
)
AGENT_QUESTIONS = [
    "Which sea lies to the east of Italy?",
    "In which country is the city of Porto?",
    "Which mountain range separates France and Spain?",
    "What is the capital of the country where the Nile ends?",
    "Which ocean lies to the west of Portugal?",
    "Which river flows through the capital of Hungary?",
    "In which country is the city of Kraków?",
    "Which language is spoken in the capital of Brazil?",
    "Which desert covers most of northern Africa?",
    "Which river flows through the capital of England?",
    "What is the largest city of the country whose capital is Canberra?",
    "Which mountain is the highest in the Alps?",
]


def prompts() -> list[dict]:
    def row(category: str, prefix: str, i: int, prompt: str) -> dict:
        return {"id": f"{prefix}-{i + 1:02d}", "category": category, "prompt": prompt}

    rows = [row("json-records", "json", i, f"{JSON_HEAD}Note: {note}\nRecord:") for i, note in enumerate(NOTES)]
    rows += [row("sql", "sql", i, f"{SQL_HEAD}-- Question: {q}\nSELECT") for i, q in enumerate(QUESTIONS)]
    for i, (name, argument, returns, what) in enumerate(FUNCTIONS):
        head = f'def {name}(store: Store, {argument}) -> {returns}:\n    """Load {what}'
        rows.append(row("house-style-code", "code", i, CODE_HEAD + head))
    rows += [
        row("agent-steps", "agent", i, f"{AGENT_HEAD}Question: {q}\nThought 1:") for i, q in enumerate(AGENT_QUESTIONS)
    ]
    return rows


def main() -> None:
    OUT.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in prompts()), encoding="utf-8")
    print(f"wrote {len(prompts())} prompts to {OUT}")


if __name__ == "__main__":
    main()
