//! The demo's broker when none answers at `--brokers`: librdkafka's
//! in-process mock cluster (three brokers, replication factor 3). It is a
//! real Kafka protocol implementation inside the librdkafka already linked,
//! so the relay and the status-mirror consumer talk to it over loopback
//! sockets exactly as to a real broker, and a first run needs no broker
//! build. Only the demo uses it; the tests use the real tansu broker.
//!
//! The mock cluster is a raw handle (not `Send`), so one thread owns it and
//! takes orders over a channel. The mock rejects the admin API: topics are
//! created through its own call, and the relay is told not to create them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::ClientConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use jobledger::relay::RelayCounters;

pub const BROKERS: i32 = 3;

enum Order {
    CreateTopic(String, i32),
    Leader(String, i32, i32),
    Down(i32),
    Up(i32),
}

type Reply = oneshot::Sender<Result<(), String>>;

pub struct MockBroker {
    orders: std::sync::mpsc::Sender<(Order, Reply)>,
    thread: Option<JoinHandle<()>>,
    pub bootstrap: String,
}

/// Whether a Kafka broker answers a metadata request at `brokers`. The
/// outer timeout bounds the client's teardown too, which waits on a name
/// lookup that never answers (the thread is left to finish on its own).
pub async fn answers(brokers: &str, within: Duration) -> bool {
    let brokers = brokers.to_string();
    let probe = tokio::task::spawn_blocking(move || {
        let Ok(p) = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("log_level", "0")
            .create::<BaseProducer>()
        else {
            return false;
        };
        p.client().fetch_metadata(None, within).is_ok()
    });
    matches!(
        tokio::time::timeout(within + Duration::from_millis(500), probe).await,
        Ok(Ok(true))
    )
}

impl MockBroker {
    pub fn start() -> Result<MockBroker, String> {
        let (tx, rx) = std::sync::mpsc::channel::<(Order, Reply)>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("mock-kafka".into())
            .spawn(move || {
                let cluster = match MockCluster::new(BROKERS) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(cluster.bootstrap_servers()));
                // Runs until the sender is dropped; the cluster goes with it.
                for (order, reply) in rx {
                    let r = match order {
                        Order::CreateTopic(t, n) => cluster.create_topic(&t, n, BROKERS),
                        Order::Leader(t, p, b) => cluster.partition_leader(&t, p, Some(b)),
                        Order::Down(b) => cluster.broker_down(b),
                        Order::Up(b) => cluster.broker_up(b),
                    };
                    let _ = reply.send(r.map_err(|e| e.to_string()));
                }
            })
            .map_err(|e| e.to_string())?;
        let bootstrap = ready_rx.recv().map_err(|e| e.to_string())??;
        Ok(MockBroker {
            orders: tx,
            thread: Some(thread),
            bootstrap,
        })
    }

    async fn order(&self, order: Order) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.orders
            .send((order, tx))
            .map_err(|_| "the mock cluster is gone".to_string())?;
        rx.await.map_err(|_| "the mock cluster is gone".to_string())?
    }

    pub async fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), String> {
        self.order(Order::CreateTopic(topic.into(), partitions)).await
    }

    async fn move_leaders(&self, topic: &str, partitions: i32, to: i32) -> Result<(), String> {
        for p in 0..partitions {
            self.order(Order::Leader(topic.into(), p, to)).await?;
        }
        Ok(())
    }
}

impl Drop for MockBroker {
    fn drop(&mut self) {
        // Closing the channel ends the owner thread, which destroys the cluster.
        let (tx, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.orders, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits (polling the relay's counter; this is a demo, not a test) until
/// `n` events went out, or the demo stops.
async fn published(counters: &RelayCounters, n: u64, stop: &CancellationToken) -> Option<u64> {
    loop {
        let now = counters.published.load(Ordering::Relaxed);
        if now >= n {
            return Some(now);
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// Faults during the relay's run, to show it rides through them: every
/// partition's leader moves to broker 2 once `first` events went out; once
/// `second` did, broker 2 goes down, the leaders fail over to broker 3 a
/// second later (the mock does not elect leaders itself), and broker 2
/// comes back. Returns what was done, a line each.
pub async fn faults(
    mock: Arc<MockBroker>,
    topic: String,
    partitions: i32,
    counters: Arc<RelayCounters>,
    (first, second): (u64, u64),
    stop: CancellationToken,
) -> Vec<String> {
    let mut done = vec![];
    let Some(at) = published(&counters, first, &stop).await else {
        return done;
    };
    eprintln!("demo: moving every partition's leader to broker 2");
    match mock.move_leaders(&topic, partitions, 2).await {
        Ok(()) => done.push(format!(
            "leaders of all {partitions} partitions moved to broker 2 at {at} events out"
        )),
        Err(e) => done.push(format!("leader move failed: {e}")),
    }
    let Some(at) = published(&counters, second, &stop).await else {
        return done;
    };
    eprintln!(
        "demo: taking broker 2 down (the relay and the consumer log connection errors until it is back)"
    );
    let down = Instant::now();
    if let Err(e) = mock.order(Order::Down(2)).await {
        done.push(format!("broker 2 down failed: {e}"));
        return done;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let failover = mock.move_leaders(&topic, partitions, 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let up = mock.order(Order::Up(2)).await;
    done.push(format!(
        "broker 2 (every leader) down at {at} events out for {:.1} s; leaders failed over to broker 3{}; broker 2 back{}",
        down.elapsed().as_secs_f64(),
        failover.err().map(|e| format!(" (failed: {e})")).unwrap_or_default(),
        up.err().map(|e| format!(" (failed: {e})")).unwrap_or_default(),
    ));
    done
}
