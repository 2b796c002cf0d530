//! Events made by hand, and a queue on the local SQS endpoint with
//! Lambda's event source mapping played by the test.

use aws_lambda_events::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};

/// A standard queue's record as Lambda hands it over.
pub(crate) fn record(id: &str, body: &str) -> SqsMessage {
    let mut m = SqsMessage::default();
    m.message_id = Some(id.to_owned());
    m.receipt_handle = Some(format!("rh-{id}"));
    m.body = Some(body.to_owned());
    m.event_source = Some("aws:sqs".into());
    m.event_source_arn = Some("arn:aws:sqs:us-east-1:123456789012:orders".into());
    m.attributes
        .insert("ApproximateReceiveCount".into(), "1".into());
    m
}

/// An event of `records`.
pub(crate) fn event(records: Vec<SqsMessage>) -> SqsEvent {
    let mut e = SqsEvent::default();
    e.records = records;
    e
}

/// The `itemIdentifier`s of a response, in order.
pub(crate) fn failures(r: &SqsBatchResponse) -> Vec<String> {
    r.batch_item_failures
        .iter()
        .map(|f| f.item_identifier.clone())
        .collect()
}

/// A queue made for one test (deleted on drop of the runtime's last use:
/// call [`Queue::delete`]).
pub(crate) struct Queue {
    pub(crate) client: Client,
    pub(crate) url: String,
    pub(crate) name: String,
}

impl Queue {
    /// A new queue with a visibility timeout of `visibility` seconds
    /// (FIFO when `fifo`, content-based deduplication off).
    pub(crate) async fn create(prefix: &str, fifo: bool, visibility: u32) -> Queue {
        let client = idem_testkit::sqs_client().await;
        let mut name = idem_testkit::unique_name(prefix);
        let mut req = client.create_queue().attributes(
            QueueAttributeName::VisibilityTimeout,
            visibility.to_string(),
        );
        if fifo {
            name.push_str(".fifo");
            req = req.attributes(QueueAttributeName::FifoQueue, "true");
        }
        let url = req
            .queue_name(&name)
            .send()
            .await
            .unwrap()
            .queue_url
            .unwrap();
        Queue { client, url, name }
    }

    /// Sends `body` (FIFO: in `group`, deduplicated on `dedup`); returns the
    /// message id.
    pub(crate) async fn send(&self, body: &str, fifo: Option<(&str, &str)>) -> String {
        let mut req = self
            .client
            .send_message()
            .queue_url(&self.url)
            .message_body(body);
        if let Some((group, dedup)) = fifo {
            req = req.message_group_id(group).message_deduplication_id(dedup);
        }
        req.send().await.unwrap().message_id.unwrap()
    }

    /// One ReceiveMessage of up to 10 records (waiting up to `wait_s`
    /// seconds for the first), as the records of a Lambda event.
    pub(crate) async fn receive(&self, wait_s: i32) -> Vec<SqsMessage> {
        let out = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(10)
            .wait_time_seconds(wait_s)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .unwrap();
        out.messages
            .unwrap_or_default()
            .into_iter()
            .map(|m| {
                let mut r = SqsMessage::default();
                r.message_id = m.message_id;
                r.receipt_handle = m.receipt_handle;
                r.body = m.body;
                r.md5_of_body = m.md5_of_body;
                r.attributes = m
                    .attributes
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v))
                    .collect();
                r.event_source = Some("aws:sqs".into());
                r.event_source_arn =
                    Some(format!("arn:aws:sqs:us-east-1:123456789012:{}", self.name));
                r.aws_region = Some("us-east-1".into());
                r
            })
            .collect()
    }

    /// Applies a batch's response as Lambda's event source mapping does:
    /// deletes every record not listed in `batchItemFailures`, leaves the
    /// listed ones to come back after the visibility timeout. Returns the
    /// ids deleted.
    pub(crate) async fn apply(
        &self,
        records: &[SqsMessage],
        response: &SqsBatchResponse,
    ) -> Vec<String> {
        let listed = failures(response);
        let mut deleted = Vec::new();
        for r in records {
            let id = r.message_id.clone().unwrap();
            if listed.contains(&id) {
                continue;
            }
            self.client
                .delete_message()
                .queue_url(&self.url)
                .receipt_handle(r.receipt_handle.clone().unwrap())
                .send()
                .await
                .unwrap();
            deleted.push(id);
        }
        deleted
    }

    /// Messages the queue holds, visible or in flight.
    pub(crate) async fn depth(&self) -> u64 {
        let attrs = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .unwrap()
            .attributes
            .unwrap_or_default();
        attrs.values().map(|v| v.parse::<u64>().unwrap_or(0)).sum()
    }

    pub(crate) async fn delete(self) {
        let _ = self.client.delete_queue().queue_url(&self.url).send().await;
    }
}

impl Queue {
    /// A queue made by another process.
    pub(crate) async fn attach(url: String, name: String) -> Queue {
        Queue {
            client: idem_testkit::sqs_client().await,
            url,
            name,
        }
    }
}
