"""The Flower ClientApp (``fl_app.client_app:app``): thin wiring to the client registry.

The train/evaluate config names the client class (``algorithm``); the roster
query is answered by the base class. No Hydra, no shared disk: everything
arrives in the message or lives in the node's context.
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients import CLIENTS
from clients.base import FederatedClient
from fl_app import keys

app = ClientApp()


def client_for(message: Message, context: Context) -> FederatedClient:
    """Instantiate the client class the message's config names."""
    config = message.content.config_records[keys.CONFIG]
    return CLIENTS.get(str(config[keys.ALGORITHM]))(message, context)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of local work for the configured algorithm."""
    return client_for(message, context).train()


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluation for the configured algorithm."""
    return client_for(message, context).evaluate()


@app.query(keys.QUERY_ROSTER)
def roster(message: Message, context: Context) -> Message:
    """Report this client's partition id and data set size."""
    return FederatedClient(message, context).describe()
